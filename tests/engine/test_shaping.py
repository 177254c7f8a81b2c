"""Strength shaping: schedules over the sampling progress and per-layer (block) weights."""

from __future__ import annotations

import pytest
import torch

from lora_engine import SlotBank, load_adapter
from lora_engine.blocks import BlockWeights, block_of, layer_weights, layout, presets
from lora_engine.errors import ShapingError
from lora_engine.grid import GridError, build, parse_axis
from lora_engine.schedule import Product, Schedule, Switch, step_progress
from lora_engine.request import Entry

from .support import lora_files as lf

SD15_ATTN = ([f"diffusion_model.input_blocks.{i}.1.proj_in" for i in (1, 2, 4, 5, 7, 8)]
             + ["diffusion_model.middle_block.1.proj_in"]
             + [f"diffusion_model.output_blocks.{i}.1.proj_in" for i in range(3, 12)])
SD15_ALL = ([f"diffusion_model.input_blocks.{i}.0.op" for i in range(12)] + ["diffusion_model.middle_block.0.c"]
            + [f"diffusion_model.output_blocks.{i}.0.c" for i in range(12)] + ["diffusion_model.time_embed.0"])


@pytest.fixture
def adapter(tmp_path):
    return load_adapter(lf.write(tmp_path, "a.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 3, rank=3)), name="a")


def out(model, x):
    with torch.no_grad():
        return model(x)


# -- schedules ---------------------------------------------------------------------------------------------

def test_schedule_interpolation_and_holds():
    s = Schedule.parse("0:1.0, 0.6:1.0, 1.0:0.2")
    assert [s.at(p) for p in (0, 0.3, 0.6, 1.0)] == [1.0, 1.0, 1.0, 0.2]
    assert s.at(0.8) == pytest.approx(0.6)
    step = Schedule.parse("0.25:0; 0.5:1", "step")
    assert [step.at(p) for p in (0, 0.25, 0.49, 0.5, 1.0)] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert Schedule.parse("0:0.7").constant == 0.7 and s.constant is None


def test_schedule_from_values_gives_one_value_per_step():
    s = Schedule.from_values([0.0, 0.5, 1.0, 2.0], "step")
    assert [s.at(i / 4) for i in range(4)] == [0.0, 0.5, 1.0, 2.0]


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("0.5", "progress:multiplier"), ("0:1, 1.5:1", "within 0"), ("0.6:1, 0.2:0", "increasing"),
    ("0:nan", "not finite"), ("0:x", "not a number"), ("0:1000", "-100"),
])
def test_malformed_schedules_say_what_is_expected(text, words):
    with pytest.raises(ShapingError, match=words):
        Schedule.parse(text)


def test_step_progress_keeps_the_step_between_two_sigmas():
    sigmas = [14.6, 7.0, 3.0, 1.0, 0.0]
    assert [step_progress(s, sigmas) for s in (14.6, 7.0, 3.0, 1.0)] == [0.0, 0.25, 0.5, 0.75]
    assert step_progress(5.0, sigmas) == 0.25  # a DPM-2 midpoint of step 1
    assert step_progress(7.0 * (1 + 1e-7), sigmas) == 0.25  # float noise on a list entry


# -- block layouts -----------------------------------------------------------------------------------------

def test_block_of_reads_every_family():
    assert block_of("diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q").label == "IN04"
    assert block_of("diffusion_model.middle_block.1.proj_in").label == "MID"
    assert block_of("diffusion_model.double_blocks.3.img_attn.qkv").label == "D03"
    assert block_of("diffusion_model.single_blocks.12.linear1").label == "S12"
    assert block_of("diffusion_model.blocks.7.self_attn.q").label == "B07"
    assert block_of("diffusion_model.time_embed.0") is None


def test_presets_follow_the_model_groups():
    assert set(presets(layout(SD15_ALL))) == {"ALL", "NONE", "IN", "NO-IN", "MID", "NO-MID", "OUT", "NO-OUT"}
    flux = layout([f"double_blocks.{i}.x" for i in range(3)] + [f"single_blocks.{i}.x" for i in range(4)])
    assert {"DOUBLE", "NO-SINGLE"} <= set(presets(flux))
    dit = layout([f"blocks.{i}.x" for i in range(6)])
    base, w = BlockWeights.parse("first-half").resolve(dit, dit)
    assert [w[b] for b in dit] == [1, 1, 1, 0, 0, 0] and base == 1


def test_inspire_vector_goes_to_the_blocks_the_lora_touches():
    model, touched = layout(SD15_ALL), layout(SD15_ATTN)
    base, w = BlockWeights.parse("SD-MIDD:0.5,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1,1").resolve(model, touched)
    assert base == 0.5
    assert {b.label for b, v in w.items() if v == 0} == {"IN01", "IN02", "IN04", "IN05", "IN07", "IN08"}
    assert w[touched[6]] == 1 and w[model[0]] == 1  # MID, and IN00 that the LoRA does not touch
    full = BlockWeights.parse(",".join(["1"] + ["0"] * 12 + ["1"] * 13)).resolve(model, touched)[1]
    assert {b.label for b, v in full.items() if v == 0} == {f"IN{i:02d}" for i in range(12)}


def test_wrong_vector_length_names_both_layouts():
    with pytest.raises(ShapingError, match=r"expected 17 .* or 26"):
        BlockWeights.parse("1,0,1").resolve(layout(SD15_ALL), layout(SD15_ATTN))


@pytest.mark.parametrize("text, words", [
    ("IN99=0", "names no block"), ("FOO=1", "unknown block name"), ("A,1,1", "not supported"),
    ("1 0.5,1", "not supported"), ("IN=x", "NAME=value"), ("SD-ALL", "does not exist"), ("", "empty"),
    ("IN04-01=0", "runs backwards; write IN01-04"), ("IN" + "5" * 5000 + "=0", "no model has a block numbered"),
])
def test_malformed_block_weights(text, words):
    with pytest.raises(ShapingError, match=words):
        BlockWeights.parse(text).resolve(layout(SD15_ALL), layout(SD15_ATTN))


def test_named_weights_and_base():
    model = layout(SD15_ALL)
    base, w = BlockWeights.parse("OUT03-05=0.5, MID=0, default=2").resolve(model, model)
    assert base == 2 and w[model[0]] == 2
    assert [w[b] for b in model if b.label in ("OUT03", "OUT05", "OUT06")] == [0.5, 0.5, 2]
    weights = layer_weights(SD15_ALL, base, w)
    assert weights["diffusion_model.time_embed.0"] == 2 and weights["diffusion_model.middle_block.0.c"] == 0


# -- the slot bank ------------------------------------------------------------------------------------------

def test_constant_schedule_is_bit_identical_to_the_plain_strength(adapter):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([(adapter, 0.8)])
    plain = out(model, x)
    bank.activate([Entry(adapter, 0.8, Schedule.parse("0:1, 1:1"))])
    for p in (0.0, 0.37, 1.0):
        bank.set_progress(p)
        assert torch.equal(out(model, x), plain)


def test_schedule_sets_the_strength_at_each_progress(adapter):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    ref = {}
    for s in (0.0, 0.5, 1.0):
        bank.activate([(adapter, s)])
        ref[s] = out(model, x)
    bank.activate([Entry(adapter, 1.0, Schedule.parse("0:0, 0.5:0.5, 1:1", "step"))])
    copies = bank.copies
    for p, s in ((0.0, 0.0), (0.5, 0.5), (0.75, 0.5), (1.0, 1.0), (0.2, 0.0)):
        bank.set_progress(p)
        assert torch.equal(out(model, x), ref[s]), p
    assert bank.copies == copies  # the adapter stayed in its slot
    bank.set_progress(0.0)
    assert bank.strengths.all_zero  # a zero multiplier skips every hook


def test_a_switch_gives_each_entry_its_turns(tmp_path, adapter):
    """Two entries every 2 steps of 8: the first on at steps 0, 1, 4, 5, the second at 2, 3, 6, 7; the step is counted
    from the progress and the step count, as the host gives them."""
    other = load_adapter(lf.write(tmp_path, "b.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 4, rank=2)),
                         name="b")
    x, model = lf.tiny_input(), lf.tiny()
    bank = SlotBank(model, max_loras=2)
    alone = {}
    for name, pair in (("a", [(adapter, 0.8), (other, 0.0)]), ("b", [(adapter, 0.0), (other, -0.6)])):
        bank.activate(pair)
        alone[name] = out(model, x)
    bank.activate([Entry(adapter, 0.8, Switch(0, 2, every=2)), Entry(other, -0.6, Switch(1, 2, every=2))])
    copies = bank.copies
    for step, name in enumerate("aabbaabb"):
        bank.set_progress(step / 8, 8)
        assert torch.equal(out(model, x), alone[name]), step
    assert bank.copies == copies  # both stayed in their slots


def test_a_switch_counts_steps_and_multiplies_a_schedule():
    turn = Switch(1, 3, every=1)
    assert [turn.at(i / 6, 6) for i in range(6)] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert Switch(0, 1).constant == 1.0 and turn.constant is None
    assert (turn.at(0.0), Switch(0, 3).at(0.0)) == (0.0, 1.0)  # step 0 without a count
    with pytest.raises(ShapingError, match="a LoRA switch counts steps, but this sampling gave no step list"):
        turn.at(0.5)
    both = Product(Schedule.parse("0:1, 0.5:0.25", "step"), turn)
    assert [both.at(i / 6, 6) for i in range(6)] == [0.0, 1.0, 0.0, 0.0, 0.25, 0.0]
    assert both.describe() == "0:1, 0.5:0.25 (step) × switch 2 of 3, every 1 step"
    for bad in ((3, 3, 1), (0, 2, 0), (-1, 2, 1)):
        with pytest.raises(ShapingError, match="a switch needs"):
            Switch(*bad)


def test_per_item_schedules(adapter):
    x = lf.tiny_input(batch=2)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    bank.activate([Entry(adapter, 1.0, (Schedule.parse("0:1"), Schedule.parse("0:0, 1:1")))])
    bank.set_progress(0.5)
    got = out(model, x)
    for i, s in enumerate((1.0, 0.5)):
        bank.activate([(adapter, s)])
        assert torch.allclose(got[i], out(model, x)[i], atol=1e-6)


def test_all_ones_layer_weights_equal_none(adapter):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    bank.activate([(adapter, 0.7)])
    plain = out(model, x)
    bank.activate([Entry(adapter, 0.7, layer_weights={"proj": 1.0, "ff": 1.0})])
    assert torch.equal(out(model, x), plain)
    assert all(layer.factor is None for layer in bank.layers.values())


def test_zero_layer_weights_equal_a_file_without_those_layers(tmp_path):
    tensors = lf.lora_tensors(lf.tiny(), "kohya", 3, rank=3)
    full = load_adapter(lf.write(tmp_path, "full.safetensors", tensors), name="full")
    cut = load_adapter(lf.write(tmp_path, "cut.safetensors",
                                {k: v for k, v in tensors.items() if "to_q" not in k and "ff" not in k}), name="cut")
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    bank.activate([(cut, 0.9)])
    ref = out(model, x)
    bank.activate([Entry(full, 0.9, layer_weights={"attn.to_q": 0.0, "ff": 0.0})])
    assert torch.equal(out(model, x), ref)
    assert bank.layers["ff"].idle and not bank.layers["proj"].idle


def test_layer_weights_scale_one_layer(adapter):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    h = torch.ones(1, 32)
    with torch.no_grad():
        bank.activate([(adapter, 0.5)])
        half, everywhere = model.head(h), out(model, x)
        bank.activate([Entry(adapter, 1.0, layer_weights={"head": 0.5})])
        assert torch.allclose(model.head(h), half, atol=1e-6)
    assert not torch.allclose(out(model, x), everywhere, atol=1e-4)  # the other layers are at 1.0


def test_per_item_layer_weights_equal_separate_runs(adapter):
    x = lf.tiny_input(batch=3)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    items = ({"proj": 0.0}, None, {"ff": 2.0, "head": 0.0})
    bank.activate([Entry(adapter, 0.8, layer_weights=items)])
    got = out(model, x)
    for i, w in enumerate(items):
        bank.activate([Entry(adapter, 0.8, layer_weights=w)])
        assert torch.allclose(got[i], out(model, x)[i], atol=1e-6), i


def test_warm_zero_slots_are_not_computed(tmp_path):
    model = lf.tiny()
    a = load_adapter(lf.write(tmp_path, "a.safetensors", lf.lora_tensors(model, "kohya", 3, rank=3)), name="a")
    b = load_adapter(lf.write(tmp_path, "b.safetensors", lf.lora_tensors(model, "peft", 4, rank=2)), name="b")
    x = lf.tiny_input(batch=2)
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, 0.7)])
    alone = out(model, x)
    bank.activate([(a, 0.7), (b, 0.0)])
    layer = bank.layers["proj"]
    assert layer.hi == 1 and layer.lr_used == {0, 1}  # b's slot is warm but cut from the GEMMs
    assert torch.equal(out(model, x), alone)
    bank.activate([(a, 0.0), (b, 0.0)])
    assert all(layer.idle for layer in bank.layers.values()) and bank.strengths.all_zero
    bank.activate([(a, 0.0), (b, [0.0, 0.5])])  # per item: live when any item is not 0
    assert layer.hi == 2
    per_item = out(model, x)
    bank.activate([(b, 0.5)])
    assert torch.allclose(per_item[1], out(model, x)[1], atol=1e-6)
    bank.activate([(b, 0.0)])
    assert torch.equal(per_item[0], out(model, x)[0])


def test_shaped_duplicate_and_mismatched_items_are_refused(adapter):
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    with pytest.raises(ShapingError, match="appears twice"):
        bank.activate([(adapter, 1.0), Entry(adapter, 0.5, Schedule.parse("0:1"))])
    with pytest.raises(ShapingError, match="different lengths"):
        bank.activate([Entry(adapter, [0.1, 0.2, 0.3], layer_weights=({}, {}))])
    assert bank.slots == [None, None]


# -- grid axes ----------------------------------------------------------------------------------------------

def test_grid_axes_over_blocks_and_schedules():
    kind, values = parse_axis("blocks: ALL | IN04=0, MID=0 | 1,0,1")
    assert kind == "blocks" and [v.kind for v in values] == ["preset", "named", "vector"]
    kind, values = parse_axis("schedule step: 0:1 | 0:0, 0.5:1")
    assert kind == "schedule" and values[1].mode == "step"
    grid = build(["a", "b"], [1.0, 0.5], [("x", "#1", "0, 1"), ("y", "#1", "schedule: 0:1 | 0:0, 1:1")])
    assert grid.table(0, 4) == [[0.0, 1.0, 0.0, 1.0], [0.5] * 4]
    scheds = grid.shaped_table(0, 4, "schedule", [None, None])
    assert scheds[1] is None and scheds[0][0].describe() == "0:1" and scheds[0][2].describe() == "0:0, 1:1"
    with pytest.raises(GridError, match="none may be empty"):
        parse_axis("blocks: ALL ||")
    with pytest.raises(GridError, match="x: .*not supported"):
        parse_axis("blocks: A,1", "x")
