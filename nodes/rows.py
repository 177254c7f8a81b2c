"""LoRAStackRows: up to MAX_ROWS LoRA rows in one node, each row a set of declared inputs.

Row i (1-based) is four optional inputs: `lora_i` (a loras-folder name, or "None"), `strength_model_i`,
`strength_clip_i` and `enabled_i`. The node's output is the incoming `lora_stack` followed by its rows in
row order, exactly as if each row were one chained `LoRAStack`. Every row input is a real input, so any
strength can be converted to a socket and driven by another node.

API format (`POST /prompt`); rows that are absent, "None" or disabled are left out:

    {"class_type": "LoRAStackRows", "inputs": {
        "single_strength": false,
        "lora_1": "style.safetensors", "strength_model_1": 0.8, "strength_clip_1": 0.8, "enabled_1": true,
        "lora_2": "detail.safetensors", "strength_model_2": 1.3}}

A missing `strength_model_i` is 1.0; a missing `strength_clip_i` equals `strength_model_i`; with
`single_strength` true, `strength_clip_i` is ignored and the clip gets `strength_model_i`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..lora_engine.errors import shown
from ..lora_engine.stack.entry import NONE, Entry, StackError, as_stack, entries, is_blank, strength_error

from . import bridge
from .stack import CATEGORY, STRENGTH

MAX_ROWS = 64  # one row per slot: the most slots a loader holds
FIELDS = ("enabled", "lora", "strength_model", "strength_clip")


def row_inputs(i: int, names: list[str]) -> dict:
    """The four declared inputs of row `i`, in the order the frontend shows them."""
    return {
        f"enabled_{i}": ("BOOLEAN", {"default": True, "display_name": f"row {i}", "label_on": "on",
                                     "label_off": "off",
                                     "tooltip": f"Row {i}: off leaves this LoRA out of the stack."}),
        f"lora_{i}": ([NONE, *names], {"default": NONE, "display_name": f"lora {i}",
                                       "tooltip": f"Row {i}: a LoRA file from the loras folder; None leaves "
                                                  "the row out."}),
        f"strength_model_{i}": ("FLOAT", {**STRENGTH, "display_name": f"model {i}",
                                          "tooltip": f"Row {i}: strength on the diffusion model. 0 keeps the "
                                                     "LoRA in its slot, so sweeping through 0 reloads nothing."}),
        f"strength_clip_{i}": ("FLOAT", {**STRENGTH, "display_name": f"clip {i}",
                                         "tooltip": f"Row {i}: strength on the text encoder (ignored with "
                                                    "single_strength)."}),
    }


def _number(i: int, field: str, name: str, v: object) -> float:
    if (problem := strength_error(v)) is not None:
        raise StackError(f"row {i} ({name}): {field}_{i} {problem}")
    return float(v)


def named_rows(inputs: Mapping[str, object], max_rows: int = MAX_ROWS) -> list[object]:
    """The `lora_i` values of the rows that name a LoRA, enabled or not, in row order."""
    return [n for n in (inputs.get(f"lora_{i}") for i in range(1, max_rows + 1)) if not is_blank(n)]


def switched_rows(inputs: Mapping[str, object], max_rows: int = MAX_ROWS) -> list[int]:
    """The rows that name a LoRA or are switched off: the frontend sends a row that is off with its LoRA as "None"
    (web/rows.js promptValue), so its toggle says that the row was there."""
    return [i for i in range(1, max_rows + 1)
            if not is_blank(inputs.get(f"lora_{i}")) or inputs.get(f"enabled_{i}", True) is False]


def row_entry(inputs: Mapping[str, object], i: int, single_strength: bool = False) -> Entry | None:
    """The entry row `i` of `inputs` stands for, or None for a row that is absent, "None" or off."""
    name = inputs.get(f"lora_{i}")
    if is_blank(name):
        return None
    if not isinstance(name, str):
        raise StackError(f"row {i}: lora_{i} must be a LoRA file name, got {shown(name)}")
    enabled = inputs.get(f"enabled_{i}", True)
    if not isinstance(enabled, bool):
        raise StackError(f"row {i} ({name}): enabled_{i} must be true or false, got {shown(enabled)}")
    if not enabled:
        return None
    sm = _number(i, "strength_model", name, inputs.get(f"strength_model_{i}", 1.0))
    clip_key = f"strength_clip_{i}"
    sc = sm if single_strength or clip_key not in inputs else _number(i, "strength_clip", name, inputs[clip_key])
    return Entry(name, sm, sc)


def row_entries(inputs: Mapping[str, object], single_strength: bool = False,
                max_rows: int = MAX_ROWS) -> list[Entry]:
    """The entries that rows 1..max_rows of `inputs` stand for, in row order."""
    return [e for i in range(1, max_rows + 1) if (e := row_entry(inputs, i, single_strength)) is not None]


class LoRAStackRows:
    DESCRIPTION = ("Several LoRAs in one node, one row each: a toggle, a picker and a model and clip strength. "
                   "The rows extend the incoming stack in row order, as chained LoRAStack nodes would. Every "
                   "strength is a real input that another node can drive. The node shows, per row, whether the "
                   "LoRA is cached or in a slot, how many layers it matched, and its base model, rank and "
                   "trigger words.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LORA_STACK",)
    RETURN_NAMES = ("lora_stack",)
    OUTPUT_TOOLTIPS = (("The incoming stack plus the enabled rows: a list of (lora_name, strength_model, "
                        "strength_clip)."),)
    FUNCTION = "stack"

    @classmethod
    def INPUT_TYPES(cls):
        names = bridge.lora_names()
        optional = {
            "lora_stack": ("LORA_STACK", {"tooltip": "A stack to extend: from LoRAStack, another LoRAStackRows, "
                                          "or any pack that uses (name, strength_model, strength_clip) tuples."}),
            "single_strength": ("BOOLEAN", {"default": False, "display_name": "single strength", "label_on": "on",
                                            "label_off": "off",
                                            "tooltip": "On: each row has one strength, used for the model and the "
                                                       "text encoder; the clip strengths are ignored."}),
        }
        for i in range(1, MAX_ROWS + 1):
            optional.update(row_inputs(i, names))
        return {"required": {}, "optional": optional}

    @classmethod
    def IS_CHANGED(cls, **inputs):
        return bridge.file_state("loras", named_rows(inputs))

    @bridge.host_errors
    def stack(self, lora_stack=None, single_strength=False, **rows):
        try:
            own = row_entries(rows, bool(single_strength))
            items = entries(lora_stack) + own
        except StackError as e:
            raise ValueError(str(e)) from None
        return (as_stack(items, left_out=bool(switched_rows(rows)) and not own),)
