"""LORA_STACK: a list of (lora_name, strength_model, strength_clip) 3-tuples.

This is the convention of Comfyroll, Efficiency Nodes and LoRA Manager, so their
stacks plug into ours and ours into theirs. An entry with a schedule, block
weights or a mask is a `StackItem`: still a 3-tuple to other packs, with the
shaping as attributes that only this pack reads.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, replace

from ..lora_engine.blocks import BlockWeights
from ..lora_engine.errors import shown
from ..lora_engine.found import Sought
from ..lora_engine.regions import Region
from ..lora_engine.schedule import SCHEDULES, Schedule

from . import bridge
from .pairs import AUTO, TARGETS

STRENGTH = {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01}
CATEGORY = "loaders/multilora"


@dataclass(frozen=True)
class Entry:
    name: str
    strength_model: float
    strength_clip: float
    schedule: Schedule | None = None
    blocks: BlockWeights | None = None
    region: Region | Sought | None = None  # a mask, or one LoRAAutoRegions finds

    @property
    def shaped(self) -> bool:
        """The entry has a schedule, block weights or a mask."""
        return self.schedule is not None or self.blocks is not None or self.region is not None

    def loaded(self, adapter) -> bridge.StackEntry:
        """This entry with its LoRA loaded, as the bridge applies it."""
        return bridge.StackEntry(adapter, self.strength_model, self.strength_clip, self.schedule, self.blocks,
                                 region=self.region)

    def with_shaping(self, **changes) -> Entry:
        return replace(self, **changes)


class StackItem(tuple):
    """(lora_name, strength_model, strength_clip), carrying a schedule, block weights and a mask as attributes."""

    schedule: Schedule | None
    blocks: BlockWeights | None
    region: Region | Sought | None

    def __new__(cls, name, strength_model, strength_clip, schedule=None, blocks=None, region=None):
        item = super().__new__(cls, (name, strength_model, strength_clip))
        item.schedule, item.blocks, item.region = schedule, blocks, region
        return item


class StackError(ValueError):
    pass


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
        schedule, blocks, region = (getattr(item, k, None) for k in ("schedule", "blocks", "region"))
        out.append(Entry(name, float(sm), float(sc), schedule if isinstance(schedule, SCHEDULES) else None,
                         blocks if isinstance(blocks, BlockWeights) else None,
                         region if isinstance(region, (Region, Sought)) else None))
    return out


class Stack(list):
    """A LORA_STACK list (other packs see a list) that knows when the node making it left its own entries out."""

    last_left_out = False


def as_stack(items: list[Entry], left_out: bool = False) -> list[tuple[str, float, float]]:
    """The LORA_STACK of `items`. `left_out`: the node that makes it added no entry of its own, being
    disabled, so a shaping node meant for "the one just added" (its entry empty) has nothing to shape."""
    out = Stack((e.name, e.strength_model, e.strength_clip) if not e.shaped else
                StackItem(e.name, e.strength_model, e.strength_clip, e.schedule, e.blocks, e.region)
                for e in items)
    out.last_left_out = left_out
    return out


def last_left_out(stack) -> bool:
    return bool(getattr(stack, "last_left_out", False))


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
