"""LoRAStackAsPatches: a stack as ComfyUI's own weight patches, for the save and merge nodes."""

from __future__ import annotations

from ..lora_engine.stack.entry import StackError, entries

from . import bridge
from .loader import MultiLoRALoader
from .stack import CATEGORY


class LoRAStackAsPatches:
    DESCRIPTION = ("Puts a LoRA stack on the model and the text encoder as ComfyUI's own weight patches, as a chain "
                   "of stock LoraLoaders does, so that CheckpointSave, ModelSave, CLIPSave and the model and CLIP "
                   "merges see the LoRAs: the saved or merged weights are what MultiLoRALoader samples with the same "
                   "stack. Block weights become per-layer strengths; a schedule is refused (a weight holds one "
                   "strength). For sampling, MultiLoRALoader is faster to change: moving a strength here re-patches "
                   "the weights.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP")
    OUTPUT_TOOLTIPS = ("The model with the stack as weight patches (a clone; the input is unchanged): connect it to "
                       "CheckpointSave, ModelSave or a model merge.",
                       "The text encoder with the stack's CLIP strengths as weight patches, or None when no CLIP is "
                       "connected.")
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        loader = MultiLoRALoader.INPUT_TYPES()
        return {
            "required": {
                "model": loader["required"]["model"],
                "lora_stack": ("LORA_STACK", {"tooltip": "From LoRAStack, LoRAStackRows, MultiLoRARows or any pack "
                                              "that builds (lora_name, strength_model, strength_clip) lists; "
                                              "block weights apply, schedules are refused."}),
            },
            "optional": {"clip": loader["optional"]["clip"]},
        }

    @bridge.host_errors
    def apply(self, model, lora_stack, clip=None):
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        if not items:
            return (model, clip)
        adapters = bridge.load_loras([e.name for e in items])
        return bridge.as_patches(model, clip, list(zip(adapters, items)))
