"""LoRAStrengthSchedule, LoRASwitchSchedule and LoRABlockWeights: shape stack entries over the steps or the blocks.

Both only attach numbers to an entry of the stack. MultiLoRALoader (or LoRAStrengthGrid)
turns them into the engine's scale tensor: a write before each model call for a schedule,
a per-layer factor for block weights. Nothing is re-patched, reloaded or recompiled.
"""

from __future__ import annotations

from ..lora_engine.blocks import BlockWeights
from ..lora_engine.errors import ShapingError, shown
from ..lora_engine.grid import GridError, find_entry
from ..lora_engine.schedule import MODES, Product, Schedule, Switch
from ..lora_engine.stack.entry import StackError, as_stack, entries, is_strength, last_left_out

from . import bridge
from .stack import CATEGORY

ENTRY = ("STRING", {"default": "", "tooltip": "The stack entry to shape: its file name, its name without "
                    "extension, or its position (#1 is the first). Empty: the last entry, the one just added; "
                    "when the node before left its LoRA out (disabled), nothing is shaped."})
PRESETS = ("custom", "ALL", "NONE", "IN", "NO-IN", "MID", "NO-MID", "OUT", "NO-OUT", "DOUBLE", "NO-DOUBLE",
           "SINGLE", "NO-SINGLE", "FIRST-HALF", "SECOND-HALF")


class ShapesEntry:
    """What every node that shapes one entry of a stack declares alike: its category, its one output and its stack
    input."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("LORA_STACK",)
    RETURN_NAMES = ("lora_stack",)
    STACK = ("LORA_STACK", {"tooltip": "The stack that holds the entry."})


def entry_index(items, ref: str, what: str) -> int:
    if not items:
        raise ValueError(f"{what}: the stack is empty; connect a LoRAStack first")
    if not (ref or "").strip():
        return len(items) - 1
    try:
        return find_entry([e.name for e in items], ref, what)
    except GridError as e:
        raise ValueError(str(e)) from None


def entry_list(items, text: str, what: str, purpose: str) -> list[int]:
    """The entries that `text` names, comma-separated, in its order (all of them for an empty text): two or more,
    each once; else a ValueError that says `what` names and `purpose` (a switch rotates, a composite averages)."""
    refs = [r.strip() for r in (text or "").split(",") if r.strip()]
    chosen = [entry_index(items, r, what) for r in refs] if refs else list(range(len(items)))
    doubled = sorted({items[i].name for i in chosen if chosen.count(i) > 1})
    if doubled:
        raise ValueError(f"{what}: {', '.join(doubled)} named twice; each entry is named once")
    if len(chosen) < 2:
        raise ValueError(f"{purpose} two entries or more; {what + ' names' if refs else 'the stack has'} "
                         f"{len(chosen)}")
    return chosen


def _first(v):
    return v[0] if isinstance(v, list) else v


def _floats(values) -> list[float] | None:
    """A FLOAT input that may be one number, a list, or a list of lists (from a node with list outputs)."""
    if values is None:
        return None
    out = []
    stack = list(values) if isinstance(values, (list, tuple)) else [values]
    while stack:
        v = stack.pop(0)
        if isinstance(v, (list, tuple)):
            stack[:0] = list(v)
        elif not is_strength(v):
            raise ValueError(f"values: {shown(v)} is not a finite number")
        else:
            out.append(float(v))
    return out


class LoRAStrengthSchedule(ShapesEntry):
    DESCRIPTION = ("Schedules one stack entry's strength over the sampling steps: keyframes 'progress:multiplier' "
                   "with progress 0…1 (step i of n is i/n), e.g. '0:1.0, 0.6:1.0, 1.0:0.2' fades the LoRA in the "
                   "last 40% of the steps. The multiplier scales strength_model. The LoRA stays in its slot the "
                   "whole time; each step only writes its strength. The text encoder keeps strength_clip.")
    OUTPUT_TOOLTIPS = ("The stack with the schedule on that entry, for MultiLoRALoader or LoRAStrengthGrid.",)
    FUNCTION = "schedule"
    INPUT_IS_LIST = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_stack": cls.STACK,
                "entry": ENTRY,
                "keyframes": ("STRING", {"default": "0:1.0, 0.6:1.0, 1.0:0.2", "tooltip":
                                         "'progress:multiplier' pairs, progress 0…1 in increasing order. Before "
                                         "the first and after the last keyframe its value holds."}),
                "interpolation": (list(MODES), {"tooltip": "linear: ramps between keyframes. step: a keyframe's "
                                                "value holds until the next keyframe."}),
            },
            "optional": {
                "values": ("FLOAT", {"forceInput": True, "tooltip": "A FLOAT list from another node, used "
                                     "instead of keyframes: n values split the steps into n equal parts (with "
                                     "step interpolation and n = steps, one value per step)."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, keyframes=None, interpolation=None):
        """Only the inputs it checks are named: ComfyUI skips its own checks of those it passes here (all of
        them, for a `**kwargs` signature). A linked input arrives as None and is checked when the node runs."""
        keyframes, interpolation = _first(keyframes), _first(interpolation)  # lists: INPUT_IS_LIST
        if interpolation is not None and interpolation not in MODES:
            return f"interpolation must be one of {', '.join(MODES)}, got {shown(interpolation)}"
        if keyframes is not None and not isinstance(keyframes, str):
            return f"keyframes must be text, got {shown(keyframes)}"
        if keyframes is not None and interpolation is not None:
            try:
                Schedule.parse(keyframes, interpolation)
            except ShapingError as e:
                return str(e)
        return True

    @bridge.host_errors
    def schedule(self, lora_stack, entry, keyframes, interpolation, values=None):
        stack, ref, text, mode = (_first(v) for v in (lora_stack, entry, keyframes, interpolation))
        if not (ref or "").strip() and last_left_out(stack):
            return (stack,)  # the entry just added was left out, and its schedule with it
        try:
            items = entries(stack)
            numbers = _floats(values)
            sched = Schedule.from_values(numbers, mode) if numbers else Schedule.parse(text, mode)
        except (StackError, ShapingError) as e:
            raise ValueError(str(e)) from None
        i = entry_index(items, ref, "entry")
        items[i] = items[i].with_shaping(schedule=sched)
        return (as_stack(items),)


class LoRASwitchSchedule(ShapesEntry):
    DESCRIPTION = ("LoRA Switch: one LoRA of the stack at a time, each taking its turn for 'every' steps, in the "
                   "order given (Zhong et al. 2024, 'Multi-LoRA Composition for Image Generation', where it "
                   "composed better than merging). Entries left out of 'order' keep their strength at every step "
                   "(a speed LoRA). The LoRAs stay in their slots; each step only writes strengths. The text "
                   "encoder keeps each entry's strength_clip.")
    OUTPUT_TOOLTIPS = ("The stack with the switch on its rotating entries, for MultiLoRALoader.",)
    FUNCTION = "switch"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_stack": ("LORA_STACK", {"tooltip": "The stack whose LoRAs take turns."}),
                "every": ("INT", {"default": 1, "min": 1, "max": 10000, "tooltip": "Steps each LoRA stays on "
                                  "before the next one takes over (τ). Step i belongs to entry (i // every) mod "
                                  "the number of rotating entries."}),
                "order": ("STRING", {"default": "", "tooltip": "The rotating entries in turn order, comma-"
                                     "separated: file names, names without extension or positions (#1 is the "
                                     "first). Empty: every entry of the stack, in stack order. Two or more."}),
            },
        }

    @bridge.host_errors
    def switch(self, lora_stack, every, order):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a whole number of steps of 1 or more, got {shown(every)}")
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        turns = entry_list(items, order, "order", "a switch rotates")
        for position, i in enumerate(turns):
            turn = Switch(position, len(turns), every)
            own = items[i].shaping.schedule
            items[i] = items[i].with_shaping(schedule=turn if own is None else Product(own, turn))
        return (as_stack(items),)


class LoRABlockWeights(ShapesEntry):
    DESCRIPTION = ("Weights one stack entry per model block. A preset (ALL, NONE, IN, MID, OUT and NO-… for "
                   "SD1.5/SDXL; DOUBLE, SINGLE and NO-… for Flux; FIRST-HALF, SECOND-HALF for DiTs), or with "
                   "preset 'custom' the text in 'weights': named (IN04=0, OUT03-05=0.5, MID=0, BASE=1, default=1) "
                   "or an Inspire Pack vector (BASE, then one value per block the LoRA touches). BASE covers "
                   "layers outside the blocks and also scales strength_clip. The multipliers combine with the "
                   "entry's strength and schedule; zeroed blocks cost nothing at runtime.")
    OUTPUT_TOOLTIPS = ("The stack with block weights on that entry, for MultiLoRALoader or LoRAStrengthGrid.",)
    FUNCTION = "weights"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora_stack": cls.STACK,
                "entry": ENTRY,
                "preset": (list(PRESETS), {"tooltip": "A block preset; the model's family decides which exist "
                                           "(a preset the model lacks is refused when the loader runs). "
                                           "'custom' uses the weights text."}),
                "weights": ("STRING", {"default": "1,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1", "multiline": True,
                                       "tooltip": "Used with preset 'custom'. Named: 'IN04=0, OUT=0.5' (blocks "
                                       "not named keep 'default', 1). Vector: BASE and one value per block the "
                                       "LoRA touches, in model order (Inspire Pack's layout; 'NAME:1,0,…' lines "
                                       "are accepted), or BASE and one value per block of the model."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, preset=None, weights=None):
        """As LoRAStrengthSchedule's: the two inputs it checks, and ComfyUI checks the others."""
        if preset is not None and preset not in PRESETS:
            return f"preset must be one of {', '.join(PRESETS)}, got {shown(preset)}"
        if weights is not None and not isinstance(weights, str):
            return f"weights must be text, got {shown(weights)}"
        if preset == "custom" and weights is not None:
            try:
                BlockWeights.parse(weights)
            except ShapingError as e:
                return str(e)
        return True

    @bridge.host_errors
    def weights(self, lora_stack, entry, preset, weights):
        if not (entry or "").strip() and last_left_out(lora_stack):
            return (lora_stack,)  # the entry just added was left out, and its block weights with it
        try:
            items = entries(lora_stack)
            spec = BlockWeights.parse(weights if preset == "custom" else preset)
        except (StackError, ShapingError) as e:
            raise ValueError(str(e)) from None
        i = entry_index(items, entry, "entry")
        items[i] = items[i].with_shaping(blocks=spec)
        return (as_stack(items),)
