"""ComfyUI nodes of the pack. Importing this package imports ComfyUI."""

from ..lora_engine.stack import keep_warning

from . import bridge, library, prefetch
from .as_patches import LoRAStackAsPatches
from .autoregions import LoRAAutoRegions, LoRAFoundRegions
from .composite import LoRACompositeConditioning
from .conditioning import LoRAConditioningStrengths
from .distill import DistillFuse
from .grid import LoRAGridImage, LoRAStrengthGrid
from .hashes import LoRAStackHashes
from .loader import MultiLoRALoader
from .masks import LoRAStackMask
from .multi_rows import MultiLoRARows
from .prompt_stack import LoRAStackFromPrompt
from .rows import LoRAStackRows
from .shaping import LoRABlockWeights, LoRAStrengthSchedule, LoRASwitchSchedule
from .stack import LoRAStack, LoRAStackFromJSON
from .stack_save import LoRAStackSave

NODE_CLASS_MAPPINGS = {
    "DistillFuse": DistillFuse,
    "LoRAAutoRegions": LoRAAutoRegions,
    "LoRABlockWeights": LoRABlockWeights,
    "LoRACompositeConditioning": LoRACompositeConditioning,
    "LoRAConditioningStrengths": LoRAConditioningStrengths,
    "LoRAFoundRegions": LoRAFoundRegions,
    "LoRAGridImage": LoRAGridImage,
    "LoRAStack": LoRAStack,
    "LoRAStackAsPatches": LoRAStackAsPatches,
    "LoRAStackFromJSON": LoRAStackFromJSON,
    "LoRAStackFromPrompt": LoRAStackFromPrompt,
    "LoRAStackHashes": LoRAStackHashes,
    "LoRAStackMask": LoRAStackMask,
    "LoRAStackRows": LoRAStackRows,
    "LoRAStackSave": LoRAStackSave,
    "LoRAStrengthGrid": LoRAStrengthGrid,
    "LoRAStrengthSchedule": LoRAStrengthSchedule,
    "LoRASwitchSchedule": LoRASwitchSchedule,
    "MultiLoRALoader": MultiLoRALoader,
    "MultiLoRARows": MultiLoRARows,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "DistillFuse": "DistillFuse (fuse a distilled LoRA once)",
    "LoRAAutoRegions": "LoRA Auto Regions (from attention)",
    "LoRABlockWeights": "LoRA Block Weights (Multi-LoRA)",
    "LoRACompositeConditioning": "LoRA Composite Conditioning (Multi-LoRA)",
    "LoRAConditioningStrengths": "LoRA Strengths for Conditioning (Multi-LoRA)",
    "LoRAFoundRegions": "LoRA Found Regions (masks)",
    "LoRAGridImage": "LoRA Grid Image (Multi-LoRA)",
    "LoRAStack": "LoRA Stack (Multi-LoRA)",
    "LoRAStackAsPatches": "LoRA Stack as Weight Patches (Multi-LoRA)",
    "LoRAStackFromJSON": "LoRA Stack from JSON (Multi-LoRA)",
    "LoRAStackFromPrompt": "LoRA Stack from Prompt <lora:…> (Multi-LoRA)",
    "LoRAStackHashes": "LoRA Stack Hashes (Multi-LoRA)",
    "LoRAStackMask": "LoRA Stack Mask (Multi-LoRA)",
    "LoRAStackRows": "LoRA Stack Rows (Multi-LoRA)",
    "LoRAStackSave": "Save LoRA Stack as One LoRA (Multi-LoRA)",
    "LoRAStrengthGrid": "LoRA Strength Grid (one batch)",
    "LoRAStrengthSchedule": "LoRA Strength Schedule (Multi-LoRA)",
    "LoRASwitchSchedule": "LoRA Switch Schedule (Multi-LoRA)",
    "MultiLoRALoader": "Multi-LoRA Loader (runtime)",
    "MultiLoRARows": "Multi-LoRA Loader",
}

if bridge.prompt_server() is not None:  # none where a script imports ComfyUI's modules and loads the pack in-process
    from . import routes  # noqa: F401  (registers the routes on the server)
    bridge.watch_prompts(keep_warning.warnings, keep_warning.EVENT)  # a save or merge after a runtime stack
    if prefetch.enabled():
        # A prompt queued behind a running one finds its LoRAs read.
        bridge.on_queue(lambda prompt, _client: prefetch.PREFETCH.queued(prompt))
    library.warm_up()  # the picker's first open finds the summaries read
