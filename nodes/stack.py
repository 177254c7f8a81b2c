"""LoRAStack and LoRAStackFromJSON: the nodes that make a LORA_STACK (its entries and parsing:
`lora_engine/stack/entry.py`)."""

from __future__ import annotations

from ..lora_engine.errors import shown
from ..lora_engine.stack.entry import Entry, StackError, as_stack, entries, finite_strength, parse_json_stack

from . import bridge

STRENGTH = {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01}
CATEGORY = "loaders/multilora"


class LoRAStack:
    DESCRIPTION = ("Adds one LoRA to a stack. Chain several to build a stack for MultiLoRALoader; every strength "
                   "is its own input, so any FLOAT output can drive it. A disabled entry is left out of the stack.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LORA_STACK",)
    RETURN_NAMES = ("lora_stack",)
    OUTPUT_TOOLTIPS = ("The incoming stack plus this entry: a list of (lora_name, strength_model, strength_clip).",)
    FUNCTION = "stack"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_name": (bridge.lora_names(), {"tooltip": "A LoRA file from the loras folder."}),
                "strength_model": ("FLOAT", {**STRENGTH, "tooltip": "Strength on the diffusion model. 0 keeps "
                                             "the LoRA loaded in its slot, so sweeping through 0 reloads nothing."}),
                "strength_clip": ("FLOAT", {**STRENGTH, "tooltip": "Strength on the text encoder."}),
            },
            "optional": {
                "enabled": ("BOOLEAN", {"default": True, "tooltip": "Off leaves this entry out of the stack."}),
                "lora_stack": ("LORA_STACK", {"tooltip": "A stack to extend: from another LoRAStack, or from "
                                              "any pack that uses (name, strength_model, strength_clip) tuples."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, lora_name=None, **_):
        return bridge.file_state("loras", [lora_name])

    @bridge.host_errors
    def stack(self, lora_name, strength_model, strength_clip, enabled=True, lora_stack=None):
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        if enabled:
            items.append(Entry(lora_name, finite_strength(strength_model, "strength_model", lora_name),
                               finite_strength(strength_clip, "strength_clip", lora_name)))
        return (as_stack(items, left_out=not enabled),)


class LoRAStackFromJSON:
    DESCRIPTION = ('A whole stack in one STRING, for API users: {"name": ..., "strength_model": ..., '
                   '"strength_clip": ..., "enabled": ...} or a list of such objects. A missing strength_model is '
                   "1.0; a missing strength_clip equals strength_model; a missing enabled is true. A rows preset's "
                   "file (saved from a rows node's menu) is such a list.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LORA_STACK",)
    RETURN_NAMES = ("lora_stack",)
    OUTPUT_TOOLTIPS = ("The incoming stack plus the entries from the JSON.",)
    FUNCTION = "stack"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "stack_json": ("STRING", {"multiline": True, "default": "[]",
                                          "tooltip": "JSON: one object or a list of objects with name, "
                                                     "strength_model, strength_clip and enabled."}),
            },
            "optional": {
                "lora_stack": ("LORA_STACK", {"tooltip": "A stack to extend."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, stack_json=None):
        if not isinstance(stack_json, str):
            return True  # linked from another node: checked when it runs
        try:
            items = parse_json_stack(stack_json)
        except StackError as e:
            return str(e)
        known = set(bridge.lora_names())
        for i, e in enumerate(items):
            if e.name not in known:
                return f"stack_json entry {i}: field \"name\": no LoRA named {shown(e.name)} in the loras folders"
        return True

    @classmethod
    def IS_CHANGED(cls, stack_json=None, **_):
        if not isinstance(stack_json, str):
            return ""  # linked: the node before it runs again when its value changes
        try:
            return bridge.file_state("loras", [e.name for e in parse_json_stack(stack_json)])
        except StackError as e:
            return str(e)

    @bridge.host_errors
    def stack(self, stack_json, lora_stack=None):
        try:
            return (as_stack(entries(lora_stack) + parse_json_stack(stack_json)),)
        except StackError as e:
            raise ValueError(str(e)) from None
