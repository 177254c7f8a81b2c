"""MultiLoRALoader: a stack applied at runtime through the engine's slot banks."""

from __future__ import annotations

import numbers

from ..lora_engine.errors import shown
from ..lora_engine.stack.entry import StackError, entries

from . import bridge
from .stack import CATEGORY


class MultiLoRALoader:
    DESCRIPTION = ("Applies a LoRA stack at runtime: the base weights are never modified and no weight backups "
                   "are kept. Every entry (a 0.0 strength too) holds a slot on the compute device, so moving a "
                   "strength re-patches nothing and reads no file. The LoRAs also go to the text encoder when a "
                   "CLIP is connected. Schedules and block weights from LoRAStrengthSchedule and LoRABlockWeights "
                   "are applied here; a block vector that does not fit the model is refused before sampling.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP")
    OUTPUT_TOOLTIPS = ("The model with the stack applied at runtime (a clone; the input is unchanged).",
                       "The text encoder with the stack applied, or None when no CLIP is connected.")
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model."}),
                "lora_stack": ("LORA_STACK", {"tooltip": "From LoRAStack, LoRAStackFromJSON, or any pack that "
                                              "builds (lora_name, strength_model, strength_clip) lists."}),
            },
            "optional": {
                "clip": ("CLIP", {"tooltip": "The text encoder; leave empty for a model-only stack."}),
                "max_loras": ("INT", {"default": 0, "min": 0, "max": 64, "tooltip":
                                      "Slots to hold on the device. 0 sizes them to the stack. Zero-strength "
                                      "entries count; disabled entries do not; a LoRA listed twice takes one "
                                      "slot, at the sum of its strengths. A longer stack adds slots and keeps "
                                      "the LoRAs already in theirs."}),
            },
        }

    @bridge.host_errors
    def apply(self, model, lora_stack, clip=None, max_loras=0):
        return self.applied(model, lora_stack, clip, max_loras)[:2]

    @staticmethod
    def applied(model, lora_stack, clip=None, max_loras=0):
        """(model, clip, the stack's (adapter, entry) pairs): `apply`'s work, and the adapters it took from the cache,
        so that a node built on it (MultiLoRARows) reads no file again."""
        # A linked value skips ComfyUI's range check: 10**6 slots would ask for terabytes.
        if isinstance(max_loras, bool) or not isinstance(max_loras, numbers.Integral) or not 0 <= max_loras <= 64:
            raise ValueError(f"max_loras of MultiLoRALoader must be a whole number from 0 to 64 (0: as many slots "
                             f"as the stack has LoRAs), got {shown(max_loras)}")
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        if not items:
            return (model, clip, [])
        adapters = bridge.load_loras([e.name for e in items])
        loaded = list(zip(adapters, items))
        new_model, new_clip = bridge.apply_stack(model, clip, loaded, max_loras)
        return (new_model, new_clip, loaded)
