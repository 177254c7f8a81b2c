"""MultiLoRARows: a whole LoRA stack loaded in one node that the model and the text encoder pass through.

It is LoRAStackRows followed by MultiLoRALoader, with the same rows: the rows and the incoming `lora_stack` make the
same stack (`rows.row_entries`), and `MultiLoRALoader.apply` applies it through the same engine, cache and slots.
It also outputs that stack, the trigger words of its LoRAs (`triggers`) and their Civitai resource hashes in A1111's
`Lora hashes` format (`hashes`). New outputs go after the old ones, so that saved workflows keep their links.

API format (`POST /prompt`): the inputs of MultiLoRALoader and LoRAStackRows in one node, with up to MAX_ROWS rows.
Row i (1..64) is `enabled_i`, `lora_i`, `strength_model_i`, `strength_clip_i`, as in LoRAStackRows:

    {"class_type": "MultiLoRARows", "inputs": {
        "model": ["4", 0], "clip": ["4", 1], "max_loras": 0, "single_strength": false,
        "lora_1": "style.safetensors", "strength_model_1": 0.8, "strength_clip_1": 0.8, "enabled_1": true,
        "lora_16": "detail.safetensors", "strength_model_16": 1.3}}

Rows may be left out or skipped; a missing `strength_model_i` is 1.0 and a missing `strength_clip_i` equals it.
The rows are declared (V1) inputs rather than V3 `io.Autogrow` ones: a growable template input is a socket only
(ComfyUI forces its widget to an input), while a row needs a picker, a toggle and strengths that are widgets and
can each still be linked; and declared names are the contract that validation checks key by key.
"""

from __future__ import annotations

from . import bridge
from .hashes import lora_hashes
from .loader import MultiLoRALoader
from .rows import MAX_ROWS, LoRAStackRows, named_rows, row_entries, row_inputs, switched_rows
from .stack import CATEGORY, StackError, as_stack, entries
from .triggers import sidecar_state, trigger_text


class MultiLoRARows:
    DESCRIPTION = ("A whole LoRA stack in one node: a row per LoRA with a toggle, a picker and a model and clip "
                   "strength, a toggle for all rows, up to 64 rows. It equals LoRAStackRows followed by "
                   "MultiLoRALoader: the base weights are never modified, and moving a strength reads no file. "
                   "It also outputs the stack, for other nodes, the trigger words of its LoRAs, and their "
                   "Civitai resource hashes for an image saver.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP", "LORA_STACK", "STRING", "STRING")
    RETURN_NAMES = ("MODEL", "CLIP", "LORA_STACK", "trigger_words", "lora_hashes")
    OUTPUT_TOOLTIPS = (
        "The model with the stack applied at runtime (a clone; the input is unchanged).",
        "The text encoder with the stack applied, or None when no CLIP is connected.",
        "The incoming stack plus the enabled rows, for a grid, another loader or another pack.",
        "The trigger words of the stack's LoRAs (those with a non-zero strength), comma-joined: from each file's "
        "metadata and the .json, .metadata.json or .civitai.info file beside it.",
        "A1111's 'Lora hashes' of the same LoRAs, 'name: hash, name: hash' (name: the file's stem, hash: AutoV2, the "
        "first 10 hex digits of the file's sha256), for Image Saver's additional_hashes: Civitai links the image to "
        "them. Each file is hashed once; later runs take the hash from the cache.",
    )
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        loader = MultiLoRALoader.INPUT_TYPES()
        rows = LoRAStackRows.INPUT_TYPES()["optional"]
        optional = {
            "clip": loader["optional"]["clip"],
            "lora_stack": (rows["lora_stack"][0], {"tooltip": "A stack to put before the rows: from LoRAStack, "
                                                   "LoRAStackFromPrompt, or any pack that uses (name, strength_model, "
                                                   "strength_clip) tuples."}),
            "max_loras": loader["optional"]["max_loras"],
            "single_strength": rows["single_strength"],
        }
        names = bridge.lora_names()
        for i in range(1, MAX_ROWS + 1):
            optional.update(row_inputs(i, names))
        return {"required": {"model": loader["required"]["model"]}, "optional": optional}

    @classmethod
    def IS_CHANGED(cls, **inputs):
        names = named_rows(inputs, MAX_ROWS)
        return bridge.file_state("loras", names) + "\n" + sidecar_state(names)

    @bridge.host_errors
    def load(self, model, clip=None, lora_stack=None, max_loras=0, single_strength=False, **rows):
        try:
            own = row_entries(rows, bool(single_strength), MAX_ROWS)
            stack = as_stack(entries(lora_stack) + own, left_out=bool(switched_rows(rows, MAX_ROWS)) and not own)
        except StackError as e:
            raise ValueError(str(e)) from None
        new_model, new_clip, loaded = MultiLoRALoader.applied(model, stack, clip, max_loras)
        words = trigger_text(e.adapter for e in loaded if e.strength_model != 0 or (clip is not None
                                                                                   and e.strength_clip != 0))
        return (new_model, new_clip, stack, words, lora_hashes(entries(stack), clip is not None))
