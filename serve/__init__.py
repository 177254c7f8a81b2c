"""Past one machine: what routes a ComfyUI prompt to the worker that already holds its models (`affinity`)."""
