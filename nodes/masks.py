"""LoRAStackMask: one stack entry applied only where its mask is, in the same model call as the rest of the stack."""

from __future__ import annotations

from ..lora_engine.errors import LoRAError
from ..lora_engine.regions import Region
from ..lora_engine.stack.entry import StackError, as_stack, entries, last_left_out

from . import bridge
from .shaping import ENTRY, ShapesEntry, entry_index


class LoRAStackMask(ShapesEntry):
    DESCRIPTION = ("Applies one stack entry only where its mask is: each image token takes the entry's strength "
                   "times the mask there (resampled to every layer's grid by area averaging), so two characters' "
                   "LoRAs with a left and a right mask do not bleed into each other, in one model call per step "
                   "whatever the number of masks. Rows that are no image token (text tokens, cross-attention K/V, "
                   "modulation) take text_strength. Works with MultiLoRALoader, Multi-LoRA Loader (rows) and "
                   "LoRAStrengthGrid, on SD1.x/SD2.x/SDXL UNets, Flux, Chroma, SD3, Wan 2.1/2.2 (one mask, or one "
                   "per latent frame), Qwen-Image and Lumina 2/Z-Image; other models, and calls with reference "
                   "latents, refuse the mask. The text encoder keeps strength_clip.")
    OUTPUT_TOOLTIPS = ("The stack with the mask on that entry, for MultiLoRALoader, Multi-LoRA Loader or "
                       "LoRAStrengthGrid.",)
    FUNCTION = "mask"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_stack": cls.STACK,
                "entry": ENTRY,
                "mask": ("MASK", {"tooltip": "Where the LoRA applies (1) and where not (0), at any resolution: "
                                  "stretched to the latent. One mask, one per batch item, or one per latent "
                                  "frame of a video."}),
                "feather": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 64.0, "step": 0.5, "tooltip":
                                      "A blur of the mask's edge, its radius in latent pixels (8 image pixels "
                                      "each on SD and Flux). 0: as drawn."}),
                "invert": ("BOOLEAN", {"default": False, "tooltip": "Apply the LoRA where the mask is 0."}),
                "outside": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                                      "The share of the strength kept where the mask is 0: 0 leaves the LoRA "
                                      "out there, 1 applies it everywhere."}),
                "text_strength": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                                            "The share of the strength on rows that are no image token: the "
                                            "cross-attention K/V of a UNet or Wan, the text stream of Flux, "
                                            "SD3 or Qwen-Image, modulation. They reach every image token, so "
                                            "above 0 the LoRA bleeds outside its mask; 1 with a mask of ones "
                                            "is the plain stack."}),
            },
        }

    @bridge.host_errors
    def mask(self, lora_stack, entry, mask, feather, invert, outside, text_strength):
        if not (entry or "").strip() and last_left_out(lora_stack):
            return (lora_stack,)  # the entry just added was left out, and its mask with it
        try:
            items = entries(lora_stack)
            i = entry_index(items, entry, "entry")
            region = Region.of(mask, outside, text_strength, feather, bool(invert), name=items[i].name)
        except (StackError, LoRAError) as e:
            raise ValueError(str(e)) from None
        items[i] = items[i].with_shaping(region=region)
        return (as_stack(items),)
