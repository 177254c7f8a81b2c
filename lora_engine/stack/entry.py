"""A LORA_STACK entry and the stack's parsing: a list of (lora_name, strength_model, strength_clip) 3-tuples.

This is the convention of Comfyroll, Efficiency Nodes and LoRA Manager, so their stacks plug into ours and ours
into theirs. An entry whose strength is shaped (a schedule, block weights, a mask: one `Shaping`) is a `StackItem`:
still a 3-tuple to other packs, with the shaping as the one attribute only this pack reads. No host import: the
nodes read and write stacks with these, and the bridge applies an `Entry` with its adapter.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, replace

from ..adapter import Adapter
from ..errors import shown
from ..request import Entry as EngineEntry
from .pairs import AUTO, TARGETS
from .shaping import NONE as UNSHAPED, Resolve, Shaping


@dataclass(frozen=True)
class Entry:
    """One LoRA of a stack, by file name: its model strength, one number or one per batch item (a grid's cells, a
    tuple); its CLIP strength; what shapes its strength (`shaping`)."""

    name: str
    strength_model: float | tuple[float, ...]
    strength_clip: float
    shaping: Shaping = UNSHAPED

    def with_shaping(self, **changes) -> Entry:
        """This entry with fields of its shaping replaced (`schedule=`, `blocks=`, `region=`)."""
        return replace(self, shaping=replace(self.shaping, **changes))

    def refuse_fixed(self, path: str | None, holds: str, remedy: str) -> None:
        """Refuse what needs the runtime where each layer holds one strength (`Shaping.refuse_fixed`)."""
        self.shaping.refuse_fixed(self.name, path, holds, remedy, isinstance(self.strength_model, (list, tuple)))

    def to_engine(self, adapter: Adapter, resolve: Resolve) -> tuple[EngineEntry, EngineEntry]:
        """(the engine's entry for the diffusion model, the one for the text encoder): the text encoder's takes the
        CLIP strength times the BASE block weight, and no schedule."""
        on_model, base = self.shaping.to_engine(adapter, self.strength_model, resolve)
        return on_model, EngineEntry(adapter, float(self.strength_clip) * base)


class StackItem(tuple):
    """(lora_name, strength_model, strength_clip), carrying the entry's `Shaping` as an attribute."""

    shaping: Shaping

    def __new__(cls, name, strength_model, strength_clip, shaping: Shaping = UNSHAPED):
        item = super().__new__(cls, (name, strength_model, strength_clip))
        item.shaping = shaping
        return item


class StackError(ValueError):
    """A LORA_STACK, or a stack given as JSON, that is not one: the message names the entry and the field."""


def is_strength(v: object) -> bool:
    """A finite real number, numpy's included (a bool is not a strength). The one test for every strength a node
    reads: its own inputs, a LORA_STACK's entries from any pack, JSON and rows."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


STRENGTH_LIMIT = 100.0  # the largest |strength|, as every strength widget of the pack allows


def strength_error(v: object) -> str | None:
    """Why `v` is not a usable strength ("must be ..." / "... is outside ..."), or None. ComfyUI checks a widget's
    range, but not a linked value's nor one inside another pack's stack: a strength of 1e30 samples a black
    image."""
    if not is_strength(v):
        return f"must be a finite number, got {shown(v)}"
    if abs(v) > STRENGTH_LIMIT:
        return f"= {float(v):g} is outside -100..100"
    return None


NONE = "None"  # the name of an empty row or entry, as ComfyUI's pickers and other packs' stacks write it


def is_blank(name: object) -> bool:
    """A stack entry or row that names no LoRA: no name, an empty one, or "None"."""
    return name is None or (isinstance(name, str) and name.strip() in ("", NONE))


def entries(stack) -> list[Entry]:
    """Validated entries of a LORA_STACK from any pack; empty names and 'None' placeholders are skipped."""
    if stack is None:
        return []
    if not isinstance(stack, (list, tuple)):
        raise StackError(f"lora_stack must be a list of (lora_name, strength_model, strength_clip), got "
                         f"{type(stack).__name__}")
    out = []
    for i, item in enumerate(stack):
        if not isinstance(item, (list, tuple)) or len(item) < 3:
            raise StackError(f"lora_stack entry {i} is {shown(item)}; expected (lora_name, strength_model, "
                             "strength_clip)")
        name, sm, sc = item[0], item[1], item[2]
        if is_blank(name):
            continue
        if not isinstance(name, str):
            raise StackError(f"lora_stack entry {i}: lora_name must be a string, got {shown(name)}")
        for field, v in (("strength_model", sm), ("strength_clip", sc)):
            if (problem := strength_error(v)) is not None:
                raise StackError(f"lora_stack entry {i} ({name}): {field} {problem}")
        out.append(Entry(name, float(sm), float(sc), Shaping.read(item)))
    return out


class Stack(list):
    """A LORA_STACK list (other packs see a list) that knows when the node making it left its own entries out."""

    last_left_out = False


def as_stack(items: list[Entry], left_out: bool = False) -> list[tuple[str, float, float]]:
    """The LORA_STACK of `items`. `left_out`: the node that makes it added no entry of its own, being
    disabled, so a shaping node meant for "the one just added" (its entry empty) has nothing to shape."""
    out = Stack((e.name, e.strength_model, e.strength_clip) if not e.shaping.shaped else
                StackItem(e.name, e.strength_model, e.strength_clip, e.shaping) for e in items)
    out.last_left_out = left_out
    return out


def last_left_out(stack) -> bool:
    """The node that made `stack` added no entry of its own (`as_stack`)."""
    return bool(getattr(stack, "last_left_out", False))


def finite_strength(v: object, field: str, name: str) -> float:
    """A node's strength input as a float: a NaN passes ComfyUI's min and max checks, and a linked one none at
    all."""
    if (problem := strength_error(v)) is not None:
        raise ValueError(f"{field} of {name} {problem}")
    return float(v)


FIELDS = {"name", "strength_model", "strength_clip", "enabled", "target", "lora_low"}


def parse_json_stack(text: str) -> list[Entry]:
    """Entries from `{"name": ..., "strength_model": ..., "strength_clip": ..., "enabled": ...}` or a list of them."""
    try:
        doc = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        hint = ""
        if re.match(r"\s*\[?\s*\{\s*'", text):  # ComfyUI passes an object sent in an API prompt on as its Python repr
            hint = ("; in an API prompt, send stack_json as a string holding the JSON (json.dumps of the stack), "
                    "not as an object")
        raise StackError(f"stack_json is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}{hint}") from None
    except RecursionError:
        raise StackError("stack_json is not valid JSON: nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts (4300 by default)
        raise StackError("stack_json is not valid JSON: a number has more digits than can be read") from None
    items = doc if isinstance(doc, list) else [doc]
    out = []
    for i, obj in enumerate(items):
        where = f"stack_json entry {i}"
        if not isinstance(obj, dict):
            raise StackError(f"{where}: expected an object with a \"name\", got {shown(obj)}")
        unknown = set(obj) - FIELDS
        if unknown:
            raise StackError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                             f"allowed: {', '.join(sorted(FIELDS))}")
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            raise StackError(f"{where}: field \"name\" must be a LoRA file name, got {shown(name)}")
        sm = obj.get("strength_model", 1.0)
        sc = obj.get("strength_clip", sm)
        for field, v in (("strength_model", sm), ("strength_clip", sc)):
            if not is_strength(v):
                raise StackError(f"{where} ({name}): field \"{field}\" must be a finite number, got {shown(v)}")
            if not -100 <= v <= 100:
                raise StackError(f"{where} ({name}): field \"{field}\" = {v} is outside -100..100")
        enabled = obj.get("enabled", True)
        if not isinstance(enabled, bool):
            raise StackError(f"{where} ({name}): field \"enabled\" must be true or false, got {shown(enabled)}")
        # A rows preset's Wan 2.2 pairing (web/presets.js): the stack is the high-noise model's, as MultiLoRARows'
        # LORA_STACK output is; an entry for the low-noise model alone is not in it.
        target, low = obj.get("target", "both"), obj.get("lora_low", AUTO)
        if target not in TARGETS:
            raise StackError(f"{where} ({name}): field \"target\" must be one of {', '.join(TARGETS)}, "
                             f"got {shown(target)}")
        if not isinstance(low, str):
            raise StackError(f"{where} ({name}): field \"lora_low\" must be a LoRA file name, got {shown(low)}")
        if enabled and target != "low":
            out.append(Entry(name, float(sm), float(sc)))
    return out
