"""Strengths after activation: per-item strengths, set_items, set_strength, schedules, inference mode."""

from __future__ import annotations

import pytest
import torch

from lora_engine import Entry, LoRAShapeError, NonFiniteError, Schedule, SlotBank, load_adapter
from lora_engine.errors import ShapingError

from .support import lora_files as lf
from .support.node_names import named_nodes
from .support.banks import TOL, four_adapters, run, solo


@pytest.fixture
def adapters(tmp_path):
    return four_adapters(tmp_path)


def test_per_item_strengths_equal_separate_runs(adapters):
    x = lf.tiny_input(batch=1).repeat(4, 1, 1, 1)
    a, b = adapters[:2]
    grid = [(0.0, 0.0), (1.0, 0.0), (0.0, -0.8), (0.5, 1.2)]
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, [g[0] for g in grid]), (b, [g[1] for g in grid])])
    batch = run(model, x)
    for i, (sa, sb) in enumerate(grid):
        assert (batch[i] - solo([(a, sa), (b, sb)], x[i:i + 1])[0]).abs().max() <= TOL


def test_per_item_strengths_tile_over_stacked_chunks(adapters):
    """cond and uncond batches stacked: [items..., items...] reuse the per-item strengths."""
    a = adapters[0]
    x = lf.tiny_input(batch=2)
    model = lf.tiny()
    SlotBank(model, max_loras=1).activate([(a, [0.2, 0.9])])
    stacked = run(model, torch.cat([x, x]))
    assert (stacked[2:] - stacked[:2]).abs().max() <= TOL
    assert (stacked[1] - solo([(a, 0.9)], x[1:2])[0]).abs().max() <= TOL


class Routed(torch.nn.Module):
    """A block whose `ff` Linear sees the tokens flattened over the batch, [B·L, C], as a mixture of experts'
    routed layers do (HiDream's `x.view(-1, C)`): its rows are tokens, not items."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.ff = torch.nn.Linear(8, 8)

    def forward(self, x):
        b, n, c = x.shape
        return self.ff(self.proj(x).reshape(-1, c)).reshape(b, n, c)


def test_per_item_strengths_on_a_layer_that_mixes_the_items_are_refused(tmp_path):
    """Where the host gives the call's batch (`call_rows`), a layer whose input has other rows refuses per-item
    strengths, naming itself; before, 2 items of 3 tokens gave the tokens of both items the strengths [0, 1, 0] and
    [1, 0, 1]. One strength for all items, or a weight of 0 on that layer, runs as before."""
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for n in ("proj", "ff"):
        tensors[f"lora_unet_{n}.lora_down.weight"] = torch.randn(2, 8, generator=g)
        tensors[f"lora_unet_{n}.lora_up.weight"] = torch.randn(8, 2, generator=g)
    adapter = load_adapter(lf.write(tmp_path, "routed.safetensors", tensors), pin=False)
    model, x = Routed(), torch.randn(2, 3, 8, generator=g)
    bank = SlotBank(model, max_loras=1)
    bank.activate([(adapter, [0.0, 1.0])])
    bank.strengths.call_rows = 2
    with pytest.raises(ShapingError, match=r"layer 'ff' of Routed takes an input of 6 rows in a model call of 2 "
                                           r"items: it mixes the items") as e:
        run(model, x)
    assert not named_nodes(str(e.value)), "the engine names nodes"
    bank.strengths.call_rows = 4  # cond and uncond stacked: the chunk layout is the host's to give
    with pytest.raises(ShapingError, match="12 rows in a model call of 4 items"):
        run(model, torch.cat([x, x]))
    bank.activate([Entry(adapter, [0.0, 1.0], layer_weights={"ff": 0.0})])
    bank.strengths.call_rows = 2
    weighted = run(model, x)
    bank.activate([(adapter, 1.0)])
    shared = run(model, x)
    bank.strengths.call_rows = None
    bank.activate([Entry(adapter, 1.0, layer_weights={"ff": 0.0})])
    assert (weighted[1] - run(model, x[1:])[0]).abs().max() <= TOL
    bank.deactivate()
    assert (shared - run(model, x)).abs().max() > 1e-2


def test_set_items_gives_each_item_its_strengths_until_reset(adapters):
    """`set_items` (a conditioning's strengths, one call at a time): the adapters it names take per-item strengths,
    None an item's activation strength, the others their activation strengths; None restores them all."""
    a, b, c = adapters[:3]
    x = lf.tiny_input(batch=1).repeat(3, 1, 1, 1)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=3)
    bank.activate([(a, 0.7), (b, 0.0), (c, -0.4)])
    shared = run(model, x)
    bank.set_items({a: [None, 0.0, 1.5], b: [1.0, None, 0.25]})
    per_item = run(model, x)
    for i, strengths in enumerate([(0.7, 1.0), (0.0, 0.0), (1.5, 0.25)]):
        want = solo([(a, strengths[0]), (b, strengths[1]), (c, -0.4)], x[i:i + 1])[0]
        assert (per_item[i] - want).abs().max() <= TOL
    assert (per_item[0] - shared[0]).abs().max() > 1e-3  # b's part: the check can fail
    bank.set_items({a: [None, 0.0, 1.5], b: [1.0, None, 0.25]})  # the same strengths again: nothing to write
    assert torch.equal(run(model, x), per_item)
    bank.set_items(None)
    # b stays live at 0 (its rows join the GEMM and add exact zeros), so the sum may round otherwise than `shared`'s
    assert (run(model, x) - shared).abs().max() <= TOL
    bank.set_items({c: [0.0, 0.0]})  # another batch size: a two-item call
    assert (run(model, x[:2]) - solo([(a, 0.7)], x[:2])).abs().max() <= TOL


def test_alternating_item_tables_keep_the_layers_rows(adapters):
    """Calls that alternate between tables of other zero patterns (a sampler's regions, then its negative) keep
    every slot live that one of them uses, so no layer packs its rows again; the slot at 0 adds exact zeros."""
    a, b = adapters[:2]
    x = lf.tiny_input(batch=2)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, 0.0), (b, 0.9)])
    tables = [{a: [1.0, 0.0]}, None, {a: [0.0, 0.5], b: [0.0, 0.0]}]
    wants = [[[(a, 1.0), (b, 0.9)], [(b, 0.9)]], [[(b, 0.9)]] * 2, [[(b, 0.0)], [(a, 0.5)]]]
    rows = None
    for _ in range(2):
        for table, want in zip(tables, wants):
            bank.set_items(table)
            out = run(model, x)
            for i, strengths in enumerate(want):
                assert (out[i] - solo(strengths, x[i:i + 1])[0]).abs().max() <= TOL
            now = {name: layer.rows for name, layer in bank.layers.items()}
            assert rows is None or all(now[n] is rows[n] for n in now)
            rows = now
    bank.activate([(a, 0.0), (b, 0.9)])  # a new activation: the slot at 0 is cut again
    assert all(layer.rows is None or layer.rows.key[0][0] == 1 for layer in bank.layers.values())


def test_set_items_lasts_until_the_next_activation_and_follows_the_schedule(adapters):
    from lora_engine import Schedule
    from lora_engine.request import Entry
    a, b = adapters[:2]
    x = lf.tiny_input(batch=2)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([Entry(a, 1.0, Schedule.parse("0:0, 1:1")), (b, 0.5)])
    bank.set_items({a: [0.8, None]})
    bank.set_progress(0.5)
    out = run(model, x)
    assert (out[0] - solo([(a, 0.4), (b, 0.5)], x[:1])[0]).abs().max() <= TOL
    assert (out[1] - solo([(a, 0.5), (b, 0.5)], x[1:])[0]).abs().max() <= TOL
    bank.activate([(a, 1.0), (b, 0.5)])
    assert (run(model, x) - solo([(a, 1.0), (b, 0.5)], x)).abs().max() <= TOL


def test_set_items_is_refused_on_per_item_activations_and_bad_values(adapters):
    from lora_engine import ShapingError
    a, b = adapters[:2]
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, [0.0, 1.0]), (b, 1.0)])
    with pytest.raises(ShapingError, match="already have per-item strengths"):
        bank.set_items({b: [1.0, 0.0]})
    bank.activate([(a, 1.0), (b, 1.0)])
    with pytest.raises(LoRAShapeError, match="different lengths"):
        bank.set_items({a: [1.0, 0.0], b: [1.0]})
    with pytest.raises(NonFiniteError):
        bank.set_items({a: [float("nan"), 0.0]})
    with pytest.raises(KeyError, match="not resident"):
        bank.set_items({adapters[2]: [1.0]})
    x = lf.tiny_input()
    assert (run(model, x) - solo([(a, 1.0), (b, 1.0)], x)).abs().max() <= TOL  # nothing was set


def test_layer_weighted_scales_follow_every_strength_change(tmp_path):
    """A layer with block weights keeps its weighted strengths (and their packed columns) from one step to the
    next: a slider move, a schedule's progress and per-item strengths must each reach it at the next step."""
    from lora_engine import Entry, Schedule
    model = lf.tiny()
    small = load_adapter(lf.write(tmp_path, "small.safetensors", lf.lora_tensors(model, "kohya", 1, rank=2)),
                         name="small")
    big = load_adapter(lf.write(tmp_path, "big.safetensors", lf.lora_tensors(model, "peft", 2, rank=12)),
                       name="big")
    weights = {"proj": 0.5, "conv_in": 2.0}
    x = lf.tiny_input(batch=2)
    bank = SlotBank(model, max_loras=2)
    bank.activate([Entry(big, 0.0), Entry(small, 0.7, layer_weights=weights)])
    assert bank.layers["proj"].rows.packed and bank.layers["proj"].factor is not None
    steps = [("set_strength", 0.7), ("set_strength", -1.3), ("set_strength", [0.4, -0.2]), ("set_strength", 0.9)]
    for _, value in steps:
        run(model, x)  # the previous strengths are cached in the weighted layers
        bank.set_strength(small, value)
        assert torch.allclose(run(model, x), solo([Entry(small, value, layer_weights=weights)], x), atol=TOL)
    bank.activate([Entry(big, 0.0), Entry(small, 0.8, Schedule.parse("0:1, 1:0.25"), layer_weights=weights)])
    for p in (0.0, 0.5, 1.0):
        run(model, x)
        bank.set_progress(p)
        want = solo([Entry(small, 0.8 * (1 - 0.75 * p), layer_weights=weights)], x)
        assert torch.allclose(run(model, x), want, atol=TOL), p


def test_strengths_set_under_inference_mode_can_change_outside_it(adapters):
    """A bank first activated inside `torch.inference_mode` (ComfyUI runs its nodes so) takes newcomers, swaps and
    new strengths, one per model or per item, with autograd on (as ComfyUI's training node runs its model): its
    tensors are made outside that mode, where an inference tensor would refuse every in-place write."""
    a, b = adapters[:2]
    x = lf.tiny_input()
    model = lf.tiny()
    with torch.inference_mode():
        bank = SlotBank(model, max_loras=2)
        bank.activate([(a, 1.0), (b, [0.0, 0.5])])
    bank.activate([(a, 0.5), (b, [1.0, 0.0])])
    assert (run(model, x)[0] - solo([(a, 0.5), (b, 1.0)], x[:1])[0]).abs().max() <= TOL
    bank.activate([(a, 0.5), (b, 1.0)])
    bank.set_items({a: [0.0, 1.0]})
    assert (run(model, x)[1] - solo([(a, 1.0), (b, 1.0)], x[1:])[0]).abs().max() <= TOL
    with torch.inference_mode():
        bank.activate([(a, 0.5), (b, 1.0)])
    bank.set_strength(b, 0.0)
    assert (run(model, x) - solo([(a, 0.5)], x)).abs().max() <= TOL
    c = adapters[2]
    bank.activate([(c, 0.7)])  # a swap: a slot released, a newcomer written into it
    assert (run(model, x) - solo([(c, 0.7)], x)).abs().max() <= TOL


def test_set_strength_changes_one_strength_and_keeps_the_progress_and_set_items(adapters):
    """As an activation of the same set at the new strength would give, with the schedule still at its progress and
    `set_items`' per-item strengths still set (both were reset to their start before)."""
    a, b = adapters[:2]
    x = lf.tiny_input(batch=1).repeat(2, 1, 1, 1)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([Entry(a, 1.0, Schedule.parse("0:1, 1:0")), (b, 0.5)])  # a's multiplier: 1 - progress
    bank.set_progress(0.75)
    bank.set_strength(b, 0.4)
    assert (run(model, x) - solo([(a, 0.25), (b, 0.4)], x)).abs().max() <= TOL
    bank.set_items({a: [None, 2.0]})  # item 1: a at 2.0 times the schedule's 0.25
    bank.set_strength(b, -0.3)
    got = run(model, x)
    assert (got[0] - solo([(a, 0.25), (b, -0.3)], x[:1])[0]).abs().max() <= TOL
    assert (got[1] - solo([(a, 0.5), (b, -0.3)], x[:1])[0]).abs().max() <= TOL


def test_set_strength_from_per_item_to_one_strength_leaves_per_item_mode(adapters):
    a, b = adapters[:2]
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, [0.1, 0.2, 0.3]), (b, 0.5)])
    bank.set_strength(a, 1.0)
    x = lf.tiny_input(batch=1)
    assert (run(model, x) - solo([(a, 1.0), (b, 0.5)], x)).abs().max() <= TOL  # a batch of 1 runs
    bank.set_items({a: [0.0, 1.0]})  # refused while the strengths were per item


@pytest.mark.parametrize("value,error", [([0.1, 0.2], ShapingError), (float("nan"), NonFiniteError)])
def test_set_strength_that_does_not_fit_changes_nothing(adapters, value, error):
    """Per-item schedules for 3 items: strengths for 2 do not fit them. Refused before any change (the table was
    replaced before, and every later call failed)."""
    a, b = adapters[:2]
    x = lf.tiny_input(batch=1).repeat(3, 1, 1, 1)
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    bank.activate([Entry(a, 1.0, tuple(Schedule.parse(f"0:{m}") for m in (1.0, 0.5, 0.0))), (b, 0.5)])
    before = run(model, x)
    with pytest.raises(error):
        bank.set_strength(b, value)
    assert torch.equal(run(model, x), before)
    bank.set_progress(0.5)
    bank.set_strength(b, 0.25)
    assert (run(model, x)[1] - solo([(a, 0.5), (b, 0.25)], x[:1])[0]).abs().max() <= TOL
