"""What the host tests share: the workflows and stock comparisons they build, and the scripts they run in-process with
ComfyUI's python (`*_check.py`, each run by path; its docstring says how)."""
