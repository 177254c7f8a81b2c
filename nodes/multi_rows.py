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

Wan 2.2's two experts: with `model_low` connected, each row goes to `model` (the high-noise expert) and `model_low`
(the low-noise one), each with its own bank and slots. Row i's `target_i` ("both", "high", "low"; default "both")
says which; its `lora_low_i` ("auto", the default, or a file name) is the file for `model_low`: "auto" takes the
row's partner by name (pairs.py), else the row's own file. The incoming `lora_stack` goes to both, paired by name.
The text encoder, which both experts share, takes what `model` takes; `MODEL_LOW` is the last output:

    "model_low": ["5", 0], "lora_1": "style_high_noise.safetensors", "target_1": "both", "lora_low_1": "auto",
    "lora_2": "lightning_HIGH.safetensors", "target_2": "high"
The rows are declared (V1) inputs rather than V3 `io.Autogrow` ones: a growable template input is a socket only
(ComfyUI forces its widget to an input), while a row needs a picker, a toggle and strengths that are widgets and
can each still be linked; and declared names are the contract that validation checks key by key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..lora_engine.errors import shown
from ..lora_engine.stack.entry import NONE, Entry, StackError, as_stack, entries, is_blank
from ..lora_engine.stack.pairs import AUTO, TARGETS, Pair, PairError, pair_of

from . import bridge
from .hashes import lora_hashes
from .loader import MultiLoRALoader
from .rows import MAX_ROWS, LoRAStackRows, named_rows, row_entries, row_entry, row_inputs, switched_rows
from .stack import CATEGORY
from .triggers import sidecar_state, trigger_text


def pair_inputs(i: int, names: list[str]) -> dict:
    """Row `i`'s two inputs for Wan 2.2's low-noise model, which matter only with `model_low` connected."""
    return {
        f"target_{i}": (list(TARGETS), {"default": "both", "display_name": f"target {i}", "tooltip":
                        f"Row {i}, with model_low connected: both models, the high-noise model (model) only, or "
                        f"the low-noise model (model_low) only."}),
        f"lora_low_{i}": ([AUTO, *names], {"default": AUTO, "display_name": f"low lora {i}", "tooltip":
                          f"Row {i}, with model_low connected: the file for the low-noise model. auto: the row's "
                          f"partner by name (…high_noise / …low_noise, HIGH / LOW, HN / LN, in the same folder), "
                          f"else the row's own file."}),
    }


def _pair(where: str, name: str, low: object, names: list[str]) -> Pair:
    if is_blank(low) or low == AUTO:
        try:
            return pair_of(name, names)
        except PairError as e:
            raise StackError(f"{where}: {e}") from None
    if not isinstance(low, str):
        raise StackError(f"{where} ({name}): its low file must be a LoRA file name or {AUTO!r}, got {shown(low)}")
    return Pair(name, low)


def row_pairs(rows: Mapping[str, object], incoming: list[Entry], single_strength: bool,
              names: list[str]) -> tuple[list[Entry], list[Entry]]:
    """The entries for the high-noise model and for the low-noise one: the incoming stack's, paired by name, then
    each row's, by its target and low file."""
    high = [replace(e, name=_pair(f"lora_stack entry {e.name!r}", e.name, AUTO, names).high) for e in incoming]
    low = [replace(e, name=_pair(f"lora_stack entry {e.name!r}", e.name, AUTO, names).low) for e in incoming]
    for i in range(1, MAX_ROWS + 1):
        e = row_entry(rows, i, single_strength)
        if e is None:
            continue
        target = rows.get(f"target_{i}", "both")
        if target not in TARGETS:
            raise StackError(f"row {i} ({e.name}): target_{i} must be one of {', '.join(TARGETS)}, got {shown(target)}")
        pair = _pair(f"row {i}", e.name, rows.get(f"lora_low_{i}", AUTO), names)
        if target != "low":
            high.append(replace(e, name=pair.high))
        if target != "high":
            low.append(replace(e, name=pair.low))
    return high, low


def low_targets(rows: Mapping[str, object]) -> list[int]:
    """The enabled rows that target the low-noise model only."""
    return [i for i in range(1, MAX_ROWS + 1)
            if rows.get(f"target_{i}") == "low" and not is_blank(rows.get(f"lora_{i}"))
            and rows.get(f"enabled_{i}", True) is not False]


class MultiLoRARows:
    DESCRIPTION = ("A whole LoRA stack in one node: a row per LoRA with a toggle, a picker and a model and clip "
                   "strength, a toggle for all rows, up to 64 rows. It equals LoRAStackRows followed by "
                   "MultiLoRALoader: the base weights are never modified, and moving a strength reads no file. "
                   "It also outputs the stack, for other nodes, the trigger words of its LoRAs, and their "
                   "Civitai resource hashes for an image saver.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP", "LORA_STACK", "STRING", "STRING", "MODEL")
    RETURN_NAMES = ("MODEL", "CLIP", "LORA_STACK", "trigger_words", "lora_hashes", "MODEL_LOW")
    OUTPUT_TOOLTIPS = (
        "The model with the stack applied at runtime (a clone; the input is unchanged).",
        "The text encoder with the stack applied, or None when no CLIP is connected.",
        "The incoming stack plus the enabled rows, for a grid, another loader or another pack.",
        "The trigger words of the stack's LoRAs (those with a non-zero strength), comma-joined: from each file's "
        "metadata and the .json, .metadata.json or .civitai.info file beside it.",
        "A1111's 'Lora hashes' of the same LoRAs, 'name: hash, name: hash' (name: the file's stem, hash: AutoV2, the "
        "first 10 hex digits of the file's sha256), for Image Saver's additional_hashes: Civitai links the image to "
        "them. Each file is hashed once; later runs take the hash from the cache.",
        "Wan 2.2's low-noise model with its rows applied (each row's low file, by its target), or None when "
        "model_low is not connected.",
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
        # Declared after every row, so that a workflow saved before them keeps its inputs' and widgets' positions.
        optional["model_low"] = ("MODEL", {"tooltip": "Wan 2.2's low-noise expert, with model as the high-noise one: "
                                           "each row then applies its high-noise file to model and its low-noise "
                                           "file to this model (a row's partner by name, or the file its low lora "
                                           "names), by the row's target."})
        for i in range(1, MAX_ROWS + 1):
            optional.update(pair_inputs(i, names))
        return {"required": {"model": loader["required"]["model"]}, "optional": optional}

    @classmethod
    def IS_CHANGED(cls, **inputs):
        names = named_rows(inputs, MAX_ROWS)
        names += [n for n in low_files(inputs, bridge.lora_names()) if n not in names]
        return bridge.file_state("loras", names) + "\n" + sidecar_state(names)

    @bridge.host_errors
    def load(self, model, clip=None, lora_stack=None, model_low=None, max_loras=0, single_strength=False, **rows):
        try:
            incoming = entries(lora_stack)
            if model_low is None:
                if low := low_targets(rows):
                    raise StackError(f"row {low[0]} targets the low-noise model, but model_low is not connected: "
                                     f"connect Wan 2.2's low-noise model, or set the row's target to both or high")
                high = incoming + row_entries(rows, bool(single_strength), MAX_ROWS)
                low = []
            else:
                if model_low.model is model.model:
                    raise StackError("model_low is the same model as model: connect Wan 2.2's low-noise model to "
                                     "model_low, or leave it empty for one model")
                high, low = row_pairs(rows, incoming, bool(single_strength), bridge.lora_names())
            own = len(high) - len(incoming)
            stack = as_stack(high, left_out=bool(switched_rows(rows, MAX_ROWS)) and not own)
        except StackError as e:
            raise ValueError(str(e)) from None
        new_model, new_clip, loaded = MultiLoRALoader.applied(model, stack, clip, max_loras)
        new_low, loaded_low = None, []
        if model_low is not None:
            new_low, _, loaded_low = MultiLoRALoader.applied(model_low, as_stack(low), None, max_loras)
        words = trigger_text([a for a, e in loaded if e.strength_model != 0 or (clip is not None
                                                                           and e.strength_clip != 0)]
                             + [a for a, e in loaded_low if e.strength_model != 0])
        hashes = lora_hashes(entries(stack) + [replace(e, strength_clip=0.0) for e in low], clip is not None)
        return (new_model, new_clip, stack, words, hashes, new_low)


def low_files(rows: Mapping[str, object], names: list[str]) -> list[str]:
    """The low-noise files the rows name or pair with, for IS_CHANGED (a name that pairs with nothing or with two
    files adds nothing: the run reports it)."""
    out = []
    for i in range(1, MAX_ROWS + 1):
        name, low = rows.get(f"lora_{i}"), rows.get(f"lora_low_{i}", AUTO)
        if is_blank(name) or not isinstance(name, str):
            continue
        if isinstance(low, str) and low not in (AUTO, NONE) and not is_blank(low):
            out.append(low)
            continue
        try:
            out.append(pair_of(name, names).low)
        except PairError:
            pass
    return out
