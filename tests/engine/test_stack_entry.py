"""lora_engine/stack: a LORA_STACK entry and its `Shaping`, from the tuple other packs see to the engine's entry.

The shaping travels as one value: put on an entry, written into a LORA_STACK and read back unchanged; refused by
its own methods where each layer holds one strength; mapped to `request.Entry` in one place (`to_engine`)."""

from __future__ import annotations

import pytest
import torch

from lora_engine import load_adapter
from lora_engine.blocks import BlockWeights
from lora_engine.errors import ShapingError
from lora_engine.found import Finder, Subject
from lora_engine.regions import Region
from lora_engine.schedule import Schedule
from lora_engine.stack.entry import Entry, StackError, StackItem, as_stack, entries, last_left_out
from lora_engine.stack.shaping import Shaping, finder_of

from .support import lora_files as lf

MASK = Region.of(torch.ones(1, 4, 4))
BLOCKS = BlockWeights.parse("first-half")
SCHEDULE = Schedule.parse("0:1, 1:0")


@pytest.fixture
def adapters(tmp_path):
    model = lf.tiny()
    return [load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(model, "kohya", 40 + i)), name=n)
            for i, n in enumerate("ab")]


def finder(*names: str) -> Finder:
    return Finder([Subject(n, {"l": (1 + i,)}) for i, n in enumerate(names)], {"l": 77})


def test_a_shaped_entry_is_a_three_tuple_that_carries_its_shaping_through_a_stack():
    shaped = Entry("a", 0.5, 1.0).with_shaping(schedule=SCHEDULE).with_shaping(region=MASK)
    stack = as_stack([shaped, Entry("b", 1.0, 0.0)], left_out=True)
    assert isinstance(stack[0], StackItem) and tuple(stack[0]) == ("a", 0.5, 1.0)
    assert type(stack[1]) is tuple and last_left_out(stack)
    back = entries(stack)
    assert back[0].shaping == Shaping(SCHEDULE, None, None, MASK) and back[0].shaping.shaped
    assert back[1].shaping == Shaping() and not back[1].shaping.shaped


def test_a_foreign_tuple_or_attribute_carries_no_shaping():
    item = StackItem("a", 1.0, 1.0, Shaping(schedule="0:1", blocks=BLOCKS))  # a schedule that is not one
    assert entries([item])[0].shaping == Shaping(blocks=BLOCKS)
    assert entries([["a", 1, 1], ("None", 0, 0), ("", 0, 0)]) == [Entry("a", 1.0, 1.0)]


@pytest.mark.parametrize(("stack", "message"), [
    ("a", "lora_stack must be a list of (lora_name, strength_model, strength_clip), got str"),
    ([("a", 1.0)], "lora_stack entry 0 is "),
    ([(3, 1.0, 1.0)], "lora_stack entry 0: lora_name must be a string"),
    ([("a", float("nan"), 1.0)], "lora_stack entry 0 (a): strength_model must be a finite number"),
    ([("a", 1.0, 1e30)], "lora_stack entry 0 (a): strength_clip = 1e+30 is outside -100..100"),
])
def test_a_stack_that_is_not_one_is_refused_naming_entry_and_field(stack, message):
    with pytest.raises(StackError) as e:
        entries(stack)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(("entry", "message"), [
    (Entry("a", 1.0, 1.0).with_shaping(schedule=SCHEDULE), "a has a strength schedule, which moves its strength"),
    (Entry("a", 1.0, 1.0).with_shaping(region=MASK), "a has a mask, which gives it a strength per token"),
    (Entry("a", (1.0, 0.5), 1.0), "a has one strength per batch item (a grid's cells)"),
    (Entry("a", 1.0, 1.0).with_shaping(blocks=(BLOCKS, None)), "a has one strength per batch item"),
])
def test_what_needs_the_runtime_is_refused_by_the_entry_where_a_layer_holds_one_strength(entry, message):
    with pytest.raises(ShapingError) as e:
        entry.refuse_fixed("/loras/a.safetensors", "a weight patch holds one strength", "remove it")
    assert str(e.value).startswith(message) and "a weight patch holds one strength" in str(e.value)
    assert e.value.path == "/loras/a.safetensors"


def test_block_weights_alone_pass_and_fold_through_the_resolver():
    entry = Entry("a", 1.0, 1.0).with_shaping(blocks=BLOCKS)
    entry.refuse_fixed(None, "holds", "remedy")
    assert entry.shaping.fixed_blocks(lambda spec: (0.5, {"x": 2.0})) == (0.5, {"x": 2.0})
    assert Shaping().fixed_blocks(lambda spec: pytest.fail("no block weights to resolve")) == (1.0, {})


def test_to_engine_is_the_one_mapping_of_a_shaping_to_the_engines_entries(adapters):
    a, _ = adapters
    seen = []

    def resolve(spec):
        seen.append(spec)
        return (0.25, {"layer": 3.0}) if spec is BLOCKS else (0.5, {"layer": 0.0})

    on_model, on_clip = Entry("a", 0.8, 2.0, Shaping(SCHEDULE, BLOCKS, None, MASK)).to_engine(a, resolve)
    assert (on_model.adapter, on_model.strength, on_model.schedule) == (a, 0.8, SCHEDULE)
    assert on_model.layer_weights == {"layer": 3.0} and on_model.region is MASK
    assert (on_clip.adapter, on_clip.strength, on_clip.schedule, on_clip.region) == (a, 0.5, None, None)
    own = BlockWeights.parse("last-half")
    grid = Entry("a", [1.0, 0.0], 2.0, Shaping(blocks=(BLOCKS, None), clip_blocks=own))
    on_model, on_clip = grid.to_engine(a, resolve)
    assert on_model.strength == (1.0, 0.0) and on_model.layer_weights == ({"layer": 3.0}, None)
    assert on_clip.strength == 1.0 and seen[-1] is own  # the entry's own BASE, 0.5, scales its CLIP strength


def test_a_found_region_stays_out_of_the_engines_entry_and_is_sought(adapters):
    a, b = adapters
    seek = finder("a", "b")
    first = seek.region(0)
    entry = Entry("a", 1.0, 0.0).with_shaping(region=first)
    on_model, _ = entry.to_engine(a, lambda spec: pytest.fail("no block weights"))
    assert on_model.region is None and entry.shaping.auto_region is first
    assert Entry("a", 1.0, 0.0).with_shaping(region=MASK).shaping.auto_region is None
    assert finder_of([]) is None
    assert finder_of([(b, seek.region(1)), (a, seek.region(0))]) == (seek, (a, b))


def test_seeking_refuses_two_finders_and_a_subject_the_stack_lost(adapters):
    a, b = adapters
    with pytest.raises(ShapingError, match="the stack holds the entries of two LoRAAutoRegions nodes"):
        finder_of([(a, finder("a").region(0)), (b, finder("b").region(0))])
    with pytest.raises(ShapingError, match="LoRAAutoRegions seeks the regions of b, which the stack given"):
        finder_of([(a, finder("a", "b").region(0))])
