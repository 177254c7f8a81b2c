"""Activation rules: set semantics, warm slots, limits, per-item strengths, shared bases."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from lora_engine import Entry, LoRAShapeError, NonFiniteError, Schedule, SlotBank, SlotLimitError, load_adapter
from lora_engine.errors import ShapingError

from . import lora_files as lf

TOL = 1e-5


@pytest.fixture
def adapters(tmp_path):
    model = lf.tiny()
    layouts = ["kohya", "peft", "diffusers", "kohya"]
    return [load_adapter(lf.write(tmp_path, f"a{i}.safetensors", lf.lora_tensors(model, lay, 10 + i, rank=2 + i)),
                         name=f"a{i}") for i, lay in enumerate(layouts)]


def run(model, x):
    with torch.no_grad():
        return model(x)


def solo(adapters_strengths, x):
    """The output of a fresh model with only these adapters active: the reference for every rule."""
    model = lf.tiny()
    bank = SlotBank(model, max_loras=max(1, len(adapters_strengths)))
    bank.activate(adapters_strengths)
    out = run(model, x)
    bank.release()
    return out


def test_composition_is_the_sum_of_deltas(adapters):
    x = lf.tiny_input()
    model = lf.tiny()
    base = run(model, x)
    a, b = adapters[:2]
    # Layers are not linear in the adapter, so check the first layer's output directly.
    bank = SlotBank(model, max_loras=2)
    outs = {}
    for entries in ([(a, 0.8)], [(b, -0.5)], [(a, 0.8), (b, -0.5)]):
        bank.activate(entries)
        with torch.no_grad():
            outs[len(entries), entries[0][0].name] = model.conv_in(x)
    with torch.no_grad():
        base_conv = lf.tiny().conv_in(x)
    both = outs[2, "a0"] - base_conv
    assert (both - ((outs[1, "a0"] - base_conv) + (outs[1, "a1"] - base_conv))).abs().max() <= TOL
    assert (run(model, x) - base).abs().max() > 1e-3


def test_reordering_the_set_copies_nothing(adapters):
    model = lf.tiny()
    bank = SlotBank(model, max_loras=3)
    a, b, c = adapters[:3]
    first = bank.activate([(a, 1.0), (b, 0.5), (c, -1.0)])
    assert first.copied == ("a0", "a1", "a2") and first.bytes_copied > 0
    again = bank.activate([(c, -1.0), (a, 1.0), (b, 0.5)])
    assert again.copied == () and again.bytes_copied == 0 and set(again.kept) == {"a0", "a1", "a2"}
    assert bank.copies == 3


def test_strength_change_is_a_tensor_write(adapters):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    a, b = adapters[:2]
    bank.activate([(a, 1.0), (b, 0.5)])
    buffers = {n: (layer.a.data_ptr(), layer.b.data_ptr()) for n, layer in bank.layers.items()}
    weights = {n: p.clone() for n, p in model.state_dict().items()}
    bank.set_strength(a, -0.3)
    assert {n: (layer.a.data_ptr(), layer.b.data_ptr()) for n, layer in bank.layers.items()} == buffers
    assert all(torch.equal(weights[n], p) for n, p in model.state_dict().items())
    assert (run(model, x) - solo([(a, -0.3), (b, 0.5)], x)).abs().max() <= TOL
    assert bank.copies == 2


def test_zero_strength_keeps_the_slot_and_absence_frees_it(adapters):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    a, b = adapters[:2]
    bank.activate([(a, 1.0), (b, 0.7)])
    zero = bank.activate([(a, 0.0), (b, 0.7)])
    assert zero.copied == () and bank.slots[0] is a
    assert (run(model, x) - solo([(b, 0.7)], x)).abs().max() <= TOL
    gone = bank.activate([(b, 0.7)])
    assert gone.released == ("a0",) and bank.slots[0] is None
    assert all(0 not in layer.lr_used for layer in bank.layers.values())
    assert (run(model, x) - solo([(b, 0.7)], x)).abs().max() <= TOL
    back = bank.activate([(a, 1.0), (b, 0.7)])
    assert back.copied == ("a0",)


def test_more_than_max_loras_names_adapters_and_limit(adapters):
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    with pytest.raises(SlotLimitError) as e:
        bank.activate([(a, 1.0) for a in adapters[:3]])
    msg = str(e.value)
    assert "a0" in msg and "a2" in msg and "max_loras=2" in msg
    assert bank.slots == [None, None]


def test_newcomer_replaces_a_departed_adapter_cleanly(adapters):
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    a, b, c, d = adapters
    bank.activate([(a, 1.0), (b, 1.0)])
    bank.activate([(c, 0.4), (d, -0.9)])
    assert (run(model, x) - solo([(c, 0.4), (d, -0.9)], x)).abs().max() <= TOL


def test_duplicate_entries_add_their_strengths(adapters):
    x = lf.tiny_input()
    model = lf.tiny()
    a = adapters[0]
    SlotBank(model, max_loras=1).activate([(a, 0.5), (a, 0.25)])
    assert (run(model, x) - solo([(a, 0.75)], x)).abs().max() <= TOL


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
    bank.call_rows = 2
    with pytest.raises(ShapingError, match=r"layer 'ff' of Routed takes an input of 6 rows in a model call of 2 "
                                           r"items: it mixes the items"):
        run(model, x)
    bank.call_rows = 4  # cond and uncond stacked: the chunk layout is the host's to give
    with pytest.raises(ShapingError, match="12 rows in a model call of 4 items"):
        run(model, torch.cat([x, x]))
    bank.activate([Entry(adapter, [0.0, 1.0], layer_weights={"ff": 0.0})])
    bank.call_rows = 2
    weighted = run(model, x)
    bank.activate([(adapter, 1.0)])
    shared = run(model, x)
    bank.call_rows = None
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
    from lora_engine.slots import Entry
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


def test_two_models_sharing_one_base_do_not_interfere(adapters):
    x = lf.tiny_input()
    base = lf.tiny()
    bank = SlotBank.of(base, max_loras=2)
    a, b, c = adapters[:3]
    stack_1, stack_2 = [(a, 0.9), (b, -0.4)], [(c, 1.1)]
    for _ in range(2):
        with bank.using(stack_1):
            out_1 = run(base, x)
        with bank.using(stack_2):
            out_2 = run(base, x)
        plain = run(base, x)
    assert (out_1 - solo(stack_1, x)).abs().max() <= TOL
    assert (out_2 - solo(stack_2, x)).abs().max() <= TOL
    assert (plain - run(lf.tiny(), x)).abs().max() == 0
    assert SlotBank.of(base, max_loras=2) is bank


def test_release_removes_every_hook(adapters):
    model = lf.tiny()
    bank = SlotBank.of(model, max_loras=2)
    bank.activate([(adapters[0], 1.0)])
    assert any(m._forward_hooks for m in model.modules())
    bank.release()
    assert not any(m._forward_hooks for m in model.modules())
    assert "_lora_engine_bank" not in model.__dict__


def test_half_precision_model(adapters):
    x = lf.tiny_input().to(torch.bfloat16)
    model = lf.tiny().to(torch.bfloat16)
    bank = SlotBank(model, max_loras=1)
    assert bank.dtype == torch.bfloat16
    bank.activate([(adapters[0], 1.0)])
    got = run(model, x).float()
    ref = solo([(adapters[0], 1.0)], x.float())
    assert (got - ref).abs().max() < 5e-2


@pytest.mark.parametrize("model_dtype,file_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_slots_hold_the_factors_rounded_once(tmp_path, model_dtype, file_dtype):
    """A is copied into the slot; s·B is computed in fp32 and rounded once into the model's dtype, whichever
    dtype the file stores (alpha 3 over rank 2: a scale that is not a power of two)."""
    model = lf.tiny().to(model_dtype)
    tensors = {k: v.to(file_dtype) if v.dim() > 0 else v
               for k, v in lf.lora_tensors(lf.tiny(), "kohya", 5, rank=2, alpha=3.0).items()}
    adapter = load_adapter(lf.write(tmp_path, "r.safetensors", tensors), pin=False)
    bank = SlotBank(model, max_loras=2)
    bank.activate([(adapter, 1.0)])
    for name, layer in bank.layers.items():
        w = bank.binding(adapter).plans[name].pieces[0].patch.weight
        a, b = layer.slot(bank.slots.index(adapter))
        assert torch.equal(a.reshape(w.down.shape), w.down.to(model_dtype)), name
        assert torch.equal(b, (w.up.float() * w.scale).to(model_dtype)), name


def test_fixed_slot_rank_keeps_shapes(adapters):
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2, slot_rank=8)
    bank.activate([(adapters[0], 1.0)])
    shapes = {n: tuple(layer.a.shape) for n, layer in bank.layers.items()}
    bank.activate([(adapters[3], 1.0), (adapters[1], 1.0)])
    assert {n: tuple(layer.a.shape) for n, layer in bank.layers.items()} == shapes
    assert bank.reallocations == len(shapes)


def test_a_bank_does_not_keep_evicted_adapters_alive(tmp_path):
    """Adapters the cache evicted and the bank released must be collectable: the cache bounds memory."""
    import gc
    import weakref

    from lora_engine import AdapterCache
    model = lf.tiny()
    cache = AdapterCache(max_items=2)
    bank = SlotBank(model, max_loras=1)
    refs = []
    for i in range(12):
        a = cache.load(lf.write(tmp_path, f"e{i}.safetensors", lf.lora_tensors(model, "kohya", 50 + i, rank=2)))
        bank.activate([(a, 1.0)])
        refs.append(weakref.ref(a))
        del a
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 2 + 1 + SlotBank.BINDINGS_KEPT  # cached + resident + the few recent bindings


@pytest.mark.parametrize("where", ["down", "up"])
def test_factors_that_overflow_the_model_dtype_are_refused(tmp_path, where):
    model = lf.tiny().half()
    tensors = lf.lora_tensors(lf.tiny(), "kohya", 5, rank=2)
    key = next(k for k in tensors if k.endswith(f"lora_{where}.weight"))
    tensors[key] = tensors[key].float() * 1e6  # finite in the file's fp32, past fp16's 65504 in the model
    adapter = load_adapter(lf.write(tmp_path, "big.safetensors", tensors), name="big")
    bank = SlotBank(model, max_loras=1)
    with pytest.raises(NonFiniteError, match="not finite in torch.float16"):
        bank.activate([(adapter, 1.0)])
    assert bank.slots == [None]


def test_a_slider_move_binds_nothing_and_keeps_layer_weights_right(adapters, monkeypatch):
    """Re-activating resident adapters at other strengths re-binds no adapter and walks no layer again,
    and layer weights switched on, kept, and switched off on resident adapters still give the right output."""
    import lora_engine.slots as slots
    from lora_engine import Entry

    calls = {"bind": 0, "live": 0}
    real_bind, real_live = slots.bind, slots.LayerSlots.set_live

    def counting_bind(*a, **kw):
        calls["bind"] += 1
        return real_bind(*a, **kw)

    def counting_live(self, live):
        calls["live"] += 1
        return real_live(self, live)

    monkeypatch.setattr(slots, "bind", counting_bind)
    monkeypatch.setattr(slots.LayerSlots, "set_live", counting_live)
    a, b = adapters[:2]
    x = lf.tiny_input()
    refs = {s: solo([(a, s), (b, 0.25)], x) for s in (0.75, -0.5, 1.0, 0.6)}
    model = lf.tiny()
    bank = SlotBank(model, max_loras=2)
    calls.update(bind=0, live=0)
    bank.activate([(a, 0.5), (b, 0.25)])
    assert calls["bind"] == 2 and calls["live"] > 0
    calls.update(bind=0, live=0)
    for s in (0.75, -0.5, 1.0):
        bank.activate([(a, s), (b, 0.25)])
        assert torch.allclose(run(model, x), refs[s], atol=TOL)
    assert calls == {"bind": 0, "live": 0}  # same zero pattern, same slots: nothing to find again

    weighted = {"head": 0.0, "ff": 2.0}
    bank.activate([Entry(a, 1.0, layer_weights=weighted), (b, 0.25)])
    on = run(model, x)
    bank.activate([Entry(a, 0.6, layer_weights=weighted), (b, 0.25)])  # the weights stay, the strength moves
    moved = run(model, x)
    bank.activate([(a, 0.6), (b, 0.25)])  # the weights go
    assert torch.allclose(run(model, x), refs[0.6], atol=TOL)
    bank.activate([Entry(a, 1.0, layer_weights=weighted), (b, 0.25)])
    assert torch.equal(run(model, x), on)
    assert not torch.allclose(moved, on, atol=1e-4)
    assert calls["bind"] == 0


def test_packed_slots_compute_only_live_rows(tmp_path):
    """Mixed ranks pad the small adapters' slots, and a warm slot at 0 may sit before a live one: each layer
    then computes only the live slots' filled rows, with the same output as every slot computed."""
    model = lf.tiny()
    small = load_adapter(lf.write(tmp_path, "small.safetensors", lf.lora_tensors(model, "kohya", 1, rank=2)),
                         name="small")
    big = load_adapter(lf.write(tmp_path, "big.safetensors", lf.lora_tensors(model, "peft", 2, rank=12)),
                       name="big")
    mid = load_adapter(lf.write(tmp_path, "mid.safetensors", lf.lora_tensors(model, "kohya", 3, rank=4)),
                       name="mid")
    x = lf.tiny_input(batch=3)
    cases = [
        [(big, 0.0), (small, 0.7), (mid, -0.4)],  # big is warm at 0: small and mid are packed
        [(big, 0.0), (small, [0.5, 0.0, -1.0]), (mid, 1.0)],  # per-item strengths
        [(big, 0.0), (small, 0.0), (mid, 0.9)],
    ]
    refs = [solo([e for e in entries if e[1] != 0.0], x) for entries in cases]
    bank = SlotBank(model, max_loras=3)
    for entries, ref in zip(cases, refs):
        bank.activate(entries)
        with torch.no_grad():
            got = model(x)
        assert torch.allclose(got, ref, atol=TOL)
        live = sum(r for _, r in bank.layers["proj"].rows.key)
        assert live == sum({"small": 2, "mid": 4}[e[0].name] for e in entries
                           if e[0] is not big and (e[1] != 0.0 if not isinstance(e[1], list) else any(e[1])))
    bank.activate([(big, 1.0), (small, 0.7), (mid, -0.4)])  # 18 of 36 rows: packed too
    with torch.no_grad():
        assert torch.allclose(model(x), solo([(big, 1.0), (small, 0.7), (mid, -0.4)], x), atol=TOL)
    assert bank.layers["proj"].rows.packed and bank.layers["conv_in"].rows.packed
    from lora_engine import Entry
    shaped = [Entry(big, 0.0), Entry(small, 0.7, layer_weights={"proj": 0.5, "conv_in": 2.0}), Entry(mid, -0.4)]
    bank.activate(shaped)  # layer weights take their own column scale
    assert bank.layers["proj"].factor is not None and bank.layers["proj"].rows.packed
    with torch.no_grad():
        assert torch.allclose(model(x), solo(shaped[1:], x), atol=TOL)


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


def test_a_failed_write_leaves_the_kept_adapters_as_they_were(adapters, monkeypatch):
    """A write that fails mid-activation (out of device memory, an interrupt) raises; the adapters the bank kept
    compute at their previous strengths, a newcomer already written stays warm at 0 rather than taking its
    slot's previous strength, and the next activation works."""
    from lora_engine import binding
    a, b, c, d = adapters
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=3)
    bank.activate([(a, 0.5), (b, 0.8)])
    real, calls = binding.ModulePlan.write_factors, {"n": 0}

    def failing(self, *args):
        calls["n"] += 1
        if self.path == d.path:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, *args)

    monkeypatch.setattr(binding.ModulePlan, "write_factors", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        bank.activate([(b, 0.3), (c, 1.0), (d, -0.7)])  # a leaves, c takes a's slot, d fails
    assert calls["n"] > 1 and bank.slots[0] is c
    assert torch.allclose(run(model, x), solo([(b, 0.8)], x), atol=TOL)
    monkeypatch.setattr(binding.ModulePlan, "write_factors", real)
    bank.activate([(b, 0.3), (c, 1.0), (d, -0.7)])
    assert torch.allclose(run(model, x), solo([(b, 0.3), (c, 1.0), (d, -0.7)], x), atol=TOL)


def test_a_longer_stack_grows_the_bank_around_its_adapters(adapters, monkeypatch):
    """Asking a model's bank for more slots grows it in place: the resident adapters keep their slots, strengths,
    layer weights and schedule progress (their rows are copied on the device; nothing is copied from the host or
    bound again), the output is unchanged, and the next activation copies only the newcomer."""
    import lora_engine.slots as slots
    from lora_engine import Entry, Schedule
    a, b, c = adapters[:3]
    x = lf.tiny_input(batch=2)
    stack = [Entry(a, 0.0), Entry(b, [0.6, -0.4], Schedule.parse("0:1, 1:0.5"), {"proj": 0.5, "ff": 2.0})]
    model = lf.tiny()
    bank = SlotBank.of(model, max_loras=2)
    bank.activate(stack)
    bank.set_progress(0.5)
    assert bank.layers["proj"].rows.packed  # a is warm at 0 before b: b's rows are a packed copy
    before = run(model, x)
    binds, real_bind = {"n": 0}, slots.bind

    def counting_bind(*args, **kw):
        binds["n"] += 1
        return real_bind(*args, **kw)

    monkeypatch.setattr(slots, "bind", counting_bind)
    assert SlotBank.of(model, max_loras=4) is bank
    assert bank.max_loras == 4 and bank.slots == [a, b, None, None] and bank.copies == 2
    assert all(layer.a.shape[0] == 4 * layer.rank and layer.b.shape[1] == 4 * layer.rank
               for layer in bank.layers.values() if layer.a is not None)
    assert torch.equal(run(model, x), before)
    done = bank.activate(stack + [Entry(c, 1.0)])
    assert done.copied == ("a2",) and set(done.kept) == {"a0", "a1"} and bank.slots[:3] == [a, b, c]
    assert binds["n"] == 1  # c alone
    assert torch.allclose(run(model, x), solo(stack + [Entry(c, 1.0)], x), atol=TOL)
    bank.activate([(c, 1.0)])  # the grown slots release and refill like any other
    assert torch.allclose(run(model, x), solo([(c, 1.0)], x), atol=TOL)


def test_a_failed_growth_leaves_the_bank_as_it_was(adapters, monkeypatch):
    """Every new buffer is allocated before any layer changes: running out of device memory part way leaves the
    bank at its size, with its adapters computing as before."""
    import lora_engine.slots as slots
    a, b, c = adapters[:3]
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank.of(model, max_loras=2)
    bank.activate([(a, 0.5), (b, 0.8)])
    before = run(model, x)
    real, calls = slots.LayerSlots.resize, {"n": 0}

    def failing(self, n):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, n)

    monkeypatch.setattr(slots.LayerSlots, "resize", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        SlotBank.of(model, max_loras=3)
    assert len(bank.layers) > 3 and calls["n"] == 3 + 2  # the third layer failed; the first two were put back
    assert bank.max_loras == 2 and bank.slots == [a, b]
    assert all(layer.n == 2 and layer.a.shape[0] == 2 * layer.rank and layer.b.shape[1] == 2 * layer.rank
               for layer in bank.layers.values())
    assert torch.equal(run(model, x), before)
    monkeypatch.setattr(slots.LayerSlots, "resize", real)
    SlotBank.of(model, max_loras=3).activate([(a, 0.5), (b, 0.8), (c, -1.0)])
    assert torch.allclose(run(model, x), solo([(a, 0.5), (b, 0.8), (c, -1.0)], x), atol=TOL)


def test_slots_of_one_rank_are_not_packed(tmp_path):
    model = lf.tiny()
    a, b = (load_adapter(lf.write(tmp_path, f"{n}.safetensors", lf.lora_tensors(model, "kohya", i, rank=3)), name=n)
            for i, n in enumerate("ab"))
    bank = SlotBank(model, max_loras=2)
    bank.activate([(a, 1.0), (b, 1.0)])  # every row of both slots is live: the slot buffers are used as they are
    assert not any(layer.rows.packed for layer in bank.layers.values())
    bank.activate([(a, 0.0), (b, 1.0)])  # slot 0 at 0 before the live slot 1: only slot 1's rows
    assert all(layer.rows.packed and layer.rows.key == ((1, 3),) for layer in bank.layers.values())


def test_unfilled_and_released_rows_never_reach_a_forward(tmp_path, monkeypatch):
    """Fresh slot buffers are not zero-filled and a released slot is not zeroed at once: a newcomer that fills
    every row of a slot overwrites it, and whatever is left is zeroed before the next forward. Fresh buffers are
    filled with NaN here, so that any row read before it is written or zeroed shows in the output."""
    import lora_engine.layer as layer_module

    def nan_filled(*shape, **kw):
        return torch.full(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape, float("nan"), **kw)

    monkeypatch.setattr(layer_module, "_unfilled", nan_filled)
    model = lf.tiny()
    full = load_adapter(lf.write(tmp_path, "full.safetensors", lf.lora_tensors(model, "kohya", 1, rank=4)),
                        name="full")
    part_tensors = {k: v for k, v in lf.lora_tensors(model, "kohya", 2, rank=4).items() if "ff" not in k}
    part = load_adapter(lf.write(tmp_path, "part.safetensors", part_tensors), name="part")
    small = load_adapter(lf.write(tmp_path, "small.safetensors", lf.lora_tensors(model, "kohya", 3, rank=2)),
                         name="small")
    x = lf.tiny_input()
    steps = [
        [(full, 0.6), (small, 0.3)],  # small's padding rows in a fresh slot: zeroed; 2 slots never written
        [(part, -0.5), (small, 0.8)],  # full released; part (fewer layers) and small (padding) take slots
        [(full, 1.0), (small, 0.8)],
    ]
    refs = [solo(entries, x) for entries in steps]
    bank = SlotBank(model, max_loras=4)
    compiled_view = torch.compile(model, backend="eager")  # every held slot computed, zero slots included
    for entries, ref in zip(steps, refs):
        bank.activate(entries)
        with torch.no_grad():
            got, every = model(x), compiled_view(x)
        assert torch.isfinite(got).all() and torch.allclose(got, ref, atol=TOL)
        assert torch.allclose(every, ref, atol=TOL)
        assert all(not layer.dirty for layer in bank.layers.values())


def test_pinning_packs_an_adapter_into_a_few_power_of_two_buffers(tmp_path, monkeypatch):
    """Pinned host memory comes from an allocator that rounds each request up to a power of two. Pinning packs an
    adapter's tensors into a few such buffers instead of one per tensor: every copy is exact, of the same dtype
    and shape, lies in one of the buffers, and the adapter computes what it computed unpinned; for factors of
    hundreds of bytes the buffers hold fewer bytes than a power of two per tensor would."""
    import lora_engine.adapter as adapter_module
    model = lf.tiny()
    x = lf.tiny_input()
    files = [lf.lora_tensors(model, "kohya", 3, rank=5), lf.loha_tensors(model, 4), lf.diff_tensors(model, 5),
             lf.dora_tensors(model, 6)]
    adapters = [load_adapter(lf.write(tmp_path, f"p{i}.safetensors", t), pin=False) for i, t in enumerate(files)]
    for a in adapters:
        want = solo([(a, 0.7)], x)
        before = {k: [t.clone() for t in lp.tensors()] for k, lp in a.layers.items()}
        buffers = []

        def allocate(n):
            buffers.append(torch.empty(n, dtype=torch.uint8))
            return buffers[-1]

        monkeypatch.setattr(adapter_module, "PIN_CHUNK", 1024)  # several buffers from a tiny adapter
        adapter_module._pin(a.layers, allocate)
        sizes = [b.numel() for b in buffers]
        assert all(n & (n - 1) == 0 for n in sizes) and len(sizes) > 1, (a.name, sizes)
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
        for k, lp in a.layers.items():
            for old, new in zip(before[k], lp.tensors(), strict=True):
                assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old), (a.name, k)
                assert new.stride() == old.stride(), (a.name, k)  # a column-major B stays column-major
                assert any(lo <= new.data_ptr() < hi for lo, hi in spans), (a.name, k)
        if a is adapters[0]:  # factors of hundreds of bytes; the LoHa's here are smaller than the alignment
            per_tensor = sum(adapter_module._pow2(t.numel() * t.element_size()) for lp in a.layers.values()
                             for t in lp.tensors())
            assert sum(sizes) < per_tensor, (a.name, sizes, per_tensor)
        assert torch.equal(solo([(a, 0.7)], x), want), a.name


def test_a_loaded_adapter_holds_b_column_major_laid_out_in_one_copy(tmp_path, monkeypatch):
    """Loading lays each low-rank B out column-major, with the file's values: unpinned, in one copy at load;
    pinned, in the packing copy itself, so that the factor the adapter holds lies in a pinned buffer and no second
    copy follows."""
    import lora_engine.adapter as adapter_module
    model = lf.tiny()
    path = lf.write(tmp_path, "c.safetensors", lf.lora_tensors(model, "kohya", 3, rank=4))
    stored = {k[:-len(".lora_up.weight")]: v for k, v in safetensors.torch.load_file(path).items()
              if k.endswith(".lora_up.weight")}
    buffers = []

    def allocate(n):
        buffers.append(torch.empty(n, dtype=torch.uint8))
        return buffers[-1]

    monkeypatch.setattr(adapter_module, "_pinned_bytes", allocate)
    for pin in (False, True):
        a = load_adapter(path, pin=pin)
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
        assert len(a.layers) == len(stored) and bool(spans) == pin
        for k, lp in a.layers.items():
            up = lp.weight.up
            assert up.stride() == (1, up.shape[0]) and torch.equal(up, stored[k].reshape(up.shape)), (pin, k)
            assert any(lo <= up.data_ptr() < hi for lo, hi in spans) == pin, (pin, k)


def test_each_slot_of_a_linear_holds_its_columns_of_b_as_one_dense_block(tmp_path):
    """B is column-major in the adapter and in a Linear's slot buffers, so that each slot's columns of B are one
    dense block, which a write fills in one contiguous copy; a conv's B, the 1×1 conv weight it runs as, stays
    row-major. Buffers grown for more slots or a higher rank keep the layout, and the outputs are the sum of the
    adapters' deltas throughout."""
    model = lf.tiny()
    x = lf.tiny_input()
    ads = [load_adapter(lf.write(tmp_path, f"l{i}.safetensors", lf.lora_tensors(model, lay, 20 + i, rank=r)),
                        name=f"l{i}") for i, (lay, r) in enumerate([("kohya", 3), ("peft", 2), ("locon-mid", 5)])]
    for a in ads:
        for k, lp in a.layers.items():
            up = lp.weight.up
            assert up.stride() == (1, up.shape[0]), (a.name, k, up.stride())
    bank = SlotBank(model, max_loras=2)

    def check(entries):
        bank.activate(entries)
        assert torch.allclose(run(model, x), solo(entries, x), atol=TOL)
        convs = 0
        for name, layer in bank.layers.items():
            conv = layer.geometry.conv_dims > 0
            convs += conv
            assert (layer.b.is_contiguous() if conv else layer.b.stride() == (1, layer.b.shape[0])), name
            for slot in range(layer.n):
                a, b = layer.slot(slot)
                assert a.is_contiguous() and (conv or b.t().is_contiguous()), (name, slot)
        assert convs and convs < len(bank.layers)

    check([(ads[0], 0.8), (ads[1], -0.6)])
    check([(ads[0], 0.8), (ads[2], 0.5)])  # rank 5 over slots of rank 3: every buffer reallocated
    bank.grow(3)
    check([(ads[0], 0.8), (ads[1], 0.4), (ads[2], 0.5)])


def test_a_refused_newcomer_of_a_higher_rank_leaves_the_output_bit_for_bit(tmp_path):
    """A newcomer of a higher rank reallocates the layers' buffers before a later layer of it is refused (its DoRA
    magnitude is empty). The resident adapter's rows then come from a packed copy instead of the slot buffers; the
    copy is laid out as the buffers are, so that the output is the same bit for bit."""
    model = lf.tiny()
    x = lf.tiny_input()
    good = load_adapter(lf.write(tmp_path, "good.safetensors", lf.lora_tensors(model, "kohya", 7)), name="good")
    tensors = lf.lora_tensors(model, "kohya", 8, rank=8)
    tensors["lora_unet_ff.dora_scale"] = torch.ones(0)
    bad = load_adapter(lf.write(tmp_path, "bad.safetensors", tensors), name="bad")
    bank = SlotBank(model, max_loras=2)
    bank.activate([(good, 0.5)])
    before = run(model, x)
    with pytest.raises(LoRAShapeError, match="'ff'"):
        bank.activate([(good, 0.5), (bad, 1.0)])
    assert any(layer.rows is not None and layer.rows.packed for layer in bank.layers.values())
    assert torch.equal(run(model, x), before)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_slots_across_devices_take_each_host_buffer_in_one_copy(tmp_path, monkeypatch, model_dtype):
    """Slots on another device than a pinned adapter: each of the adapter's host buffers is moved in one copy, then
    its factors are copied into the slots on the device in one call per buffer (two where a conv's row-major B
    is among them), instead of one copy from the host per factor. Here on the CPU, with the slots taken as being
    on another device: the slots hold exactly what direct copies write (for a bf16 model, B of an fp32 file is
    rounded from fp32 once, from the moved buffer too), the scales of B are applied in one call for the dense
    blocks and one for a conv's columns, and a buffer far larger than what is read from it is not moved."""
    import lora_engine.adapter as adapter_module
    import lora_engine.copies as copies_module
    model = lf.tiny().to(model_dtype)
    x = lf.tiny_input().to(model_dtype)
    tensors = lf.lora_tensors(lf.tiny(), "kohya", 9, rank=4, alpha=3.0)
    direct = load_adapter(lf.write(tmp_path, "d.safetensors", tensors), name="d", pin=False)
    packed = load_adapter(lf.write(tmp_path, "p.safetensors", tensors), name="p", pin=False)
    buffers = []

    def allocate(n):
        buffers.append(torch.empty(n, dtype=torch.uint8))
        return buffers[-1]

    monkeypatch.setattr(adapter_module, "PIN_CHUNK", 2048)
    adapter_module._pin(packed.layers, allocate)
    assert len(buffers) > 2
    want_bank = SlotBank(model, max_loras=1)
    want_bank.activate([(direct, 0.7)])
    want = run(model, x)
    slots = {n: [t.clone() for t in layer.slot(0)] for n, layer in want_bank.layers.items()}
    want_bank.release()

    copies, scalings = [], []
    foreach_copy, foreach_mul = torch._foreach_copy_, torch._foreach_mul_
    monkeypatch.setattr(copies_module.SlotCopies, "_crossing", lambda self: True)
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src, **kw: copies.append(len(dst)) or
                        foreach_copy(dst, src, **kw))
    monkeypatch.setattr(torch, "_foreach_mul_", lambda ts, cs: scalings.append(
        sum(t.is_contiguous() or t.t().is_contiguous() for t in ts) in (0, len(ts))) or foreach_mul(ts, cs))
    groups = []
    by_buffer = copies_module.SlotCopies._by_buffer
    monkeypatch.setattr(copies_module.SlotCopies, "_by_buffer",
                        lambda self: (groups.append(g) or g for g in by_buffer(self)))
    bank = SlotBank(model, max_loras=2)  # two slots: a conv's slot B is columns of its row-major buffer
    bank.activate([(packed, 0.7)])
    assert len(groups) == len(buffers) and len(copies) <= 2 * len(groups), (len(groups), copies)
    assert sum(copies) == sum(len(c) for c, _ in groups)  # a call for the pairs whose strides agree, one for the rest
    assert scalings == ([True, True] if model_dtype == torch.float32 else [])  # B's scales: dense ones, then convs'
    assert sum(len(c) + len(r) for c, r in groups) == 2 * len(bank.layers)
    for n, layer in bank.layers.items():
        assert all(torch.equal(got, ref) for got, ref in zip(layer.slot(0), slots[n], strict=True)), n
    assert torch.equal(run(model, x), want)

    for lp in packed.layers.values():  # each factor as a view of a copy of its buffer: the same values and layout
        for t in lp.tensors():
            v = copies_module._view(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone(), t)
            assert torch.equal(v, t) and v.stride() == t.stride() and v.data_ptr() != t.data_ptr()

    big = torch.zeros(64, 64)  # one factor's worth read from a buffer 64 times its size: copied on its own
    group = copies_module.SlotCopies()
    group.add(torch.empty(2, 32), big[:1].view(2, 32))
    group.add(torch.empty(1, 8), big[2, :8].view(1, 8))
    assert [[s.data_ptr() == big.data_ptr() for _, s in c] for c, _ in group._by_buffer()] == [[True, False]]


def test_an_adapter_that_cannot_be_pinned_stays_in_pageable_memory(tmp_path, caplog, monkeypatch):
    """Pinned memory can run out: the adapter then keeps its tensors, unchanged, and says so in the log."""
    import lora_engine.adapter as adapter_module
    model = lf.tiny()
    a = load_adapter(lf.write(tmp_path, "p.safetensors", lf.lora_tensors(model, "kohya", 3)), pin=False)
    before = {k: lp.tensors() for k, lp in a.layers.items()}
    calls = []

    def allocate(n):
        calls.append(n)
        if len(calls) > 1:
            raise RuntimeError("CUDA error: out of memory (simulated)\nmore lines")
        return torch.empty(n, dtype=torch.uint8)

    monkeypatch.setattr(adapter_module, "PIN_CHUNK", 1024)  # two buffers: the second one fails
    with caplog.at_level("WARNING", logger="lora_engine"):
        adapter_module._pin(a.layers, allocate)
    assert len(calls) == 2
    assert all(all(n is o for n, o in zip(lp.tensors(), before[k], strict=True)) for k, lp in a.layers.items())
    assert "pinning failed: CUDA error: out of memory (simulated)" in caplog.text


@pytest.mark.parametrize("blocks", [1, 2, 19])
def test_pinned_buffers_hold_little_more_than_the_adapter(blocks):
    """Rank-32 bf16 factors of Flux-dev's double blocks (9 MB per block): the pinned buffers, each a power of two,
    hold at most 5 % more than the factors' bytes, where one buffer per tensor would hold 40 % more, and one
    buffer for the whole adapter up to twice as much."""
    import lora_engine.adapter as adapter_module
    shapes = [(9216, 3072), (3072, 3072), (12288, 3072), (3072, 12288), (18432, 3072)] * 2 * blocks
    tensors = [torch.empty(*s, dtype=torch.bfloat16, device="meta") for o, i in shapes for s in ((32, i), (o, 32))]
    sizes = []

    def allocate(n):
        sizes.append(n)
        return torch.empty(n, dtype=torch.uint8, device="meta")

    moved = adapter_module._pack(tensors, allocate)
    raw = sum(t.numel() * t.element_size() for t in tensors)
    assert len(moved) == len(tensors) and all(n & (n - 1) == 0 for n in sizes)
    assert sum(sizes) <= 1.05 * raw, (blocks, sizes, raw)
    assert sum(adapter_module._pow2(t.numel() * t.element_size()) for t in tensors) > 1.4 * raw


class LinearLike(torch.nn.Module):
    """A Linear that does not derive from nn.Linear, as ComfyUI's mixed-precision layers of quantized
    (fp8-scaled) models do not."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


def test_a_layer_that_computes_a_linear_without_deriving_from_it_is_bound(tmp_path):
    from lora_engine.keymap import bindable
    plain, other = lf.tiny(), lf.tiny()
    for name, m in list(other.named_modules()):
        if isinstance(m, torch.nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(other.get_submodule(parent), leaf, LinearLike(m))
    files = {"lora": lf.lora_tensors(plain, "kohya", 3), "dora": lf.dora_tensors(plain, 4),
             "loha": lf.loha_tensors(plain, 5)}
    entries = [(load_adapter(lf.write(tmp_path, f"{k}.safetensors", t)), s)
               for (k, t), s in zip(files.items(), (0.8, -0.6, 0.5))]
    x = lf.tiny_input()
    assert torch.equal(run(plain, x), run(other, x))
    outs = []
    for model in (plain, other):
        bank = SlotBank(model, max_loras=3)
        bank.activate(entries)
        assert len(bank.layers) == len(lf.LAYERS)
        outs.append(run(model, x))
    assert (outs[0] - outs[1]).abs().max() <= TOL
    assert (outs[1] - run(lf.tiny(), x)).abs().max() > 1e-2
    experts = LinearLike(torch.nn.Linear(4, 3))
    experts.weight = torch.nn.Parameter(torch.zeros(2, 3, 4))  # [experts, out, in]: not one Linear
    assert not bindable(experts)


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


def test_layer_weights_edited_in_place_and_activated_again_take_effect(adapters):
    a = adapters[0]
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    weights = {"ff": 0.0}
    bank.activate([Entry(a, 1.0, layer_weights=weights)])
    weights.update({"ff": 1.0, "head": 0.0})
    bank.activate([Entry(a, 1.0, layer_weights=weights)])
    ref = lf.tiny()
    SlotBank(ref, max_loras=1).activate([Entry(a, 1.0, layer_weights={"head": 0.0})])
    assert (run(model, x) - run(ref, x)).abs().max() <= TOL


def test_release_when_idle_runs_at_the_first_forward_without_the_stack(adapters):
    """A host's release for a bank no stack will use again is called by the first forward while the bank is
    inactive, never while a stack is active, and an activation cancels it."""
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    bank.activate([(adapters[0], 1.0)])
    released = []
    bank.release_when_idle = lambda: (released.append(True), bank.release())
    with_stack = run(model, x)
    assert not released and (with_stack - solo([(adapters[0], 1.0)], x)).abs().max() <= TOL
    bank.deactivate()
    bank.activate([(adapters[0], 0.5)])
    bank.deactivate()
    run(model, x)
    assert not released  # the activation cancelled it
    bank.release_when_idle = lambda: (released.append(True), bank.release())
    base = run(model, x)
    assert released == [True] and not bank.layers and not any(m._forward_hooks for m in model.modules())
    assert (base - solo([], x)).abs().max() == 0
