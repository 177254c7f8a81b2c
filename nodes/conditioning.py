"""LoRAConditioningStrengths: LoRA strengths for the batch items sampled with one conditioning."""

from __future__ import annotations

from ..lora_engine.stack.cond_strengths import Named, carrying
from ..lora_engine.stack.entry import StackError, entries

from . import bridge
from .stack import CATEGORY

OTHERS = ("keep", "off")


class LoRAConditioningStrengths:
    DESCRIPTION = ("Sets the strengths of the model's LoRAs for what is sampled with this conditioning: a LoRA for "
                   "one region of a regional prompt, or for the prompt and not the negative. The conditionings of a "
                   "sampler run in one batch, each at its own strengths; nothing is re-patched. The model must come "
                   "from MultiLoRALoader, and its stack must hold every LoRA named here (at strength 0 to apply one "
                   "only where a conditioning sets it). Applied to the same conditioning again, the new entries "
                   "replace those of the same LoRA.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    OUTPUT_TOOLTIPS = ("The conditioning, carrying these strengths to the model calls it is sampled in.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "conditioning": ("CONDITIONING", {"tooltip": "A prompt's conditioning, a region's (after "
                                                  "Conditioning Set Mask or Set Area), or a combination."}),
                "lora_stack": ("LORA_STACK", {"tooltip": "The LoRAs and strength_model to use for this "
                                              "conditioning, from LoRAStack or any stack node. strength_clip is not "
                                              "used: the text is already encoded. Schedules and block weights "
                                              "come from the model's stack, and shape these strengths too."}),
                "others": (list(OTHERS), {"default": "keep", "tooltip": "The model's LoRAs this stack does not name: "
                                          "keep their strengths from the model's stack, or turn them off for this "
                                          "conditioning."}),
            },
        }

    @bridge.host_errors
    def apply(self, conditioning, lora_stack, others="keep"):
        if others not in OTHERS:
            raise ValueError(f"others must be one of {', '.join(OTHERS)}, got {others!r}")
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        shaped = [e.name for e in items if e.shaping.shaped]
        if shaped:
            raise ValueError(f"{', '.join(shaped)}: a schedule or block weights on a conditioning's stack is not "
                             "used; put it on the entry of the model's stack (it shapes the strength set here too)")
        adapters = bridge.load_loras([e.name for e in items])
        named = [Named(a.fingerprint, e.name, e.strength_model) for a, e in zip(adapters, items)]
        return (carrying(conditioning, named, others_off=others == "off"),)
