"""LoRAStackFromPrompt: the `<lora:name:weight>` tags of a prompt as a LORA_STACK, and the prompt without them.

The syntax and the name resolution are in `prompt_tags`. Every tag is one stack entry, in the order written, after
the incoming `lora_stack`; the names of the entries are the files' names in the loras folders, as a picker writes
them, so the stack equals one that LoRAStack or LoRAStackRows would build for the same files.
"""

from __future__ import annotations

from ..lora_engine.stack.entry import Entry, StackError, as_stack, entries, strength_error
from ..lora_engine.stack.prompt_tags import TagError, find_tags, resolve_name, strip_tags

from . import bridge
from .stack import CATEGORY


def prompt_entries(text: str, files: list[str]) -> list[Entry]:
    """One entry per tag of `text`, its name resolved among `files`."""
    out = []
    for tag in find_tags(text):
        for field, v in (("strength_model", tag.strength_model), ("strength_clip", tag.strength_clip)):
            if (problem := strength_error(v)) is not None:
                raise TagError(f"{tag.text}: {field} {problem}")
        out.append(Entry(resolve_name(tag.name, files, tag.text), tag.strength_model, tag.strength_clip))
    return out


class LoRAStackFromPrompt:
    DESCRIPTION = ("Reads A1111-style LoRA tags from a prompt: <lora:name:weight>, <lora:name:model_weight:clip_weight> "
                   "or <lora:name> (1.0); <lyco:…> too. Outputs the prompt without the tags and the stack they name. "
                   "A name is a file's name or its path in the loras folders, with or without the extension; a name "
                   "that two files carry, or none, is an error that lists the candidates.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING", "LORA_STACK")
    RETURN_NAMES = ("text", "lora_stack")
    OUTPUT_TOOLTIPS = ("The prompt with every LoRA tag removed and its spaces and commas tidied.",
                       "The incoming stack plus one entry per tag, in the order written.")
    FUNCTION = "stack"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "text": ("STRING", {"multiline": True, "default": "", "tooltip": "A prompt with <lora:name:weight> "
                                    "tags, as A1111, Forge, SwarmUI and LoRA Manager write them."}),
            },
            "optional": {
                "lora_stack": ("LORA_STACK", {"tooltip": "A stack to put before the prompt's LoRAs."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, text=None):
        if not isinstance(text, str):
            return True  # linked from another node: checked when it runs
        try:
            prompt_entries(text, bridge.lora_names())
        except TagError as e:
            return str(e)
        return True

    @classmethod
    def IS_CHANGED(cls, text=None, **_):
        if not isinstance(text, str):
            return ""
        try:
            return bridge.file_state("loras", [e.name for e in prompt_entries(text, bridge.lora_names())])
        except TagError as e:
            return str(e)

    @bridge.host_errors
    def stack(self, text, lora_stack=None):
        try:
            items = entries(lora_stack) + prompt_entries(text, bridge.lora_names())
        except (StackError, TagError) as e:
            raise ValueError(str(e)) from None
        return (strip_tags(text), as_stack(items))
