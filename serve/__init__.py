"""Past one machine: ComfyUI workers on Ray Serve, each prompt routed to the worker that already holds its files."""
