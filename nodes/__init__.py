"""ComfyUI nodes of the pack. Importing this package imports ComfyUI."""

from .distill import DistillFuse
from .loader import MultiLoRALoader
from .rows import LoRAStackRows
from .stack import LoRAStack, LoRAStackFromJSON

NODE_CLASS_MAPPINGS = {
    "DistillFuse": DistillFuse,
    "LoRAStack": LoRAStack,
    "LoRAStackFromJSON": LoRAStackFromJSON,
    "LoRAStackRows": LoRAStackRows,
    "MultiLoRALoader": MultiLoRALoader,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "DistillFuse": "DistillFuse (fuse a distilled LoRA once)",
    "LoRAStack": "LoRA Stack (Multi-LoRA)",
    "LoRAStackFromJSON": "LoRA Stack from JSON (Multi-LoRA)",
    "LoRAStackRows": "LoRA Stack Rows (Multi-LoRA)",
    "MultiLoRALoader": "Multi-LoRA Loader (runtime)",
}

try:
    from . import routes  # noqa: F401  (registers the routes when a server exists)
except (ImportError, AttributeError):
    routes = None
