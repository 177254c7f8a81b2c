"""LoRAStackSave: a whole stack, at its strengths, written as one LoRA file in the loras folder."""

from __future__ import annotations

import numbers

from ..lora_engine.errors import shown
from ..lora_engine.stack.entry import StackError, entries

from . import bridge
from .stack import CATEGORY

PRECISIONS = list(bridge.SAVE_DTYPES)


class LoRAStackSave:
    DESCRIPTION = ("Saves the whole stack, at its strengths, as one kohya-format LoRA file in the loras folder, "
                   "which ComfyUI's LoraLoader, A1111/Forge and diffusers read. Exact by default: the LoRAs of a "
                   "layer become one LoRA of the summed rank, and layers of DoRA, OFT, BOFT or full-diff files are "
                   "written as full diffs. A rank above 0 reduces every layer to it by SVD and reports each layer's "
                   "error. Block weights are folded into the layers' strengths; schedules are refused.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    OUTPUT_TOOLTIPS = ("The file written, its layers and rank, and with a rank each layer's relative error "
                       "‖ΔW − ΔW_rank‖ / ‖ΔW‖.",)
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model the stack is for: it names the layers."}),
                "lora_stack": ("LORA_STACK", {"tooltip": "The stack to save, from LoRAStack or any pack's "
                                              "(lora_name, strength_model, strength_clip) list."}),
                "filename": ("STRING", {"default": "stack.safetensors", "tooltip": "The file to write, "
                                        "<name>.safetensors, in the loras folder of the stack's first LoRA; a "
                                        "subfolder may be named."}),
                "rank": ("INT", {"default": 0, "min": 0, "max": 4096, "tooltip": "0 saves the stack exactly (each "
                                 "layer's rank is the sum of the LoRAs' ranks). Above 0, each layer of a higher rank "
                                 "is reduced to it by SVD, computed on the model's device."}),
                "overwrite": ("BOOLEAN", {"default": False, "tooltip": "Replace a file of that name. Off, an "
                                          "existing file is an error and is left as it is, unless it already "
                                          "holds this very save (the same prompt queued again)."}),
            },
            "optional": {
                "clip": ("CLIP", {"tooltip": "The text encoder: needed when the stack has text-encoder strengths; "
                                  "its layers are saved too."}),
                "precision": (PRECISIONS, {"default": "fp32", "tooltip": "The tensors' type in the file: fp32 keeps "
                                           "the stack exact; fp16 and bf16 halve the file."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, filename=None, lora_stack=None, **_):
        """The target file's state (it exists or not, its size and times), so that a file written, replaced or
        deleted since runs the node again; and the stack's files where the stack is known (a linked stack is not,
        at this point: the node before it runs again when its files change)."""
        names = [e[0] for e in lora_stack or () if isinstance(e, (list, tuple)) and e and isinstance(e[0], str)]
        return bridge.file_state("loras", [filename, *names])

    @bridge.host_errors
    def save(self, model, lora_stack, filename, rank, overwrite, clip=None, precision="fp32"):
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank <= 4096:
            raise ValueError(f"rank of LoRAStackSave must be a whole number from 0 (exact) to 4096, got {shown(rank)}")
        if precision not in bridge.SAVE_DTYPES:
            raise ValueError(f"precision of LoRAStackSave must be one of {', '.join(PRECISIONS)}, got "
                             f"{shown(precision)}")
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        if not items:
            raise ValueError("LoRAStackSave got an empty stack; add a LoRA to save")
        # A bad name is refused before any LoRA is read (an existing file once they are, unless it holds this save).
        bridge.save_target(filename, "loras", True, bridge.resolve("loras", items[0].name))
        adapters = bridge.load_loras([e.name for e in items])
        stack = list(zip(adapters, items))
        _, text, _ = bridge.save_stack(model, clip, stack, filename, int(rank), bool(overwrite), precision)
        return {"ui": {"text": [text]}, "result": (text,)}
