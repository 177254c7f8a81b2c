"""ComfyUI entry point. The comfy imports are guarded so that `import lora_engine` and the tests
work without ComfyUI."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)  # so that `import lora_engine` resolves to this pack's engine

WEB_DIRECTORY = "./web"

try:
    import comfy  # noqa: F401
except ImportError:  # imported outside ComfyUI (tests, tools)
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
