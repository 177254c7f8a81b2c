"""LoRACompositeConditioning (LoRA Composite): each LoRA's own guidance, averaged, in one batch per step."""

from __future__ import annotations

from ..lora_engine.stack.cond_strengths import Named, carrying
from ..lora_engine.stack.entry import StackError
from ..lora_engine.stack.entry import entries as stack_entries

from . import bridge
from .shaping import entry_list
from .stack import CATEGORY


class LoRACompositeConditioning:
    DESCRIPTION = ("LoRA Composite (Zhong et al. 2024, 'Multi-LoRA Composition for Image Generation'): the "
                   "sampler's guidance becomes the mean over the composed LoRAs of each one's own guidance, "
                   "uncondᵢ + cfg·(condᵢ − uncondᵢ), each LoRA alone. Gives the prompt and the negative one copy "
                   "per composed LoRA, each copy with the other composed LoRAs at 0; ComfyUI averages the copies "
                   "of a prompt, and samples all 2N in one batch per step. Entries not composed keep their "
                   "strength in every copy (a speed LoRA). The model must come from MultiLoRALoader with this "
                   "stack.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("positive", "negative")
    OUTPUT_TOOLTIPS = ("The prompt, one copy per composed LoRA.", "The negative, one copy per composed LoRA.")
    FUNCTION = "compose"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "positive": ("CONDITIONING", {"tooltip": "The prompt's conditioning."}),
                "negative": ("CONDITIONING", {"tooltip": "The negative conditioning."}),
                "lora_stack": ("LORA_STACK", {"tooltip": "The stack of the model being sampled (the one given "
                                              "to MultiLoRALoader)."}),
                "entries": ("STRING", {"default": "", "tooltip": "The entries to compose, comma-separated: file "
                                       "names, names without extension or positions (#1 is the first). Empty: "
                                       "every entry. Two or more."}),
            },
        }

    @bridge.host_errors
    def compose(self, positive, negative, lora_stack, entries=""):
        try:
            items = stack_entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        chosen = entry_list(items, entries, "entries", "a composite averages")
        adapters = bridge.load_loras([items[i].name for i in chosen])
        names = [Named(a.fingerprint, items[i].name, 0.0) for a, i in zip(adapters, chosen)]
        copies = [[n for j, n in enumerate(names) if j != k] for k in range(len(names))]  # copy k: the others at 0
        return ([c for off in copies for c in carrying(positive, off)],
                [c for off in copies for c in carrying(negative, off)])
