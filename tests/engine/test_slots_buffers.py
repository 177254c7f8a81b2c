"""Slot buffers: packed live rows, unfilled rows, B's layout, growth in place, failed writes and growth."""

from __future__ import annotations

import pytest
import torch

from lora_engine import EngineError, SlotBank, load_adapter

from .support import lora_files as lf
from .support.banks import TOL, four_adapters, run, solo


@pytest.fixture
def adapters(tmp_path):
    return four_adapters(tmp_path)


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


def test_a_failed_write_leaves_the_kept_adapters_as_they_were(adapters, monkeypatch):
    """A write that fails mid-activation (out of device memory, an interrupt) raises; the adapters the bank kept
    compute at their previous strengths, a newcomer already written stays warm at 0 rather than taking its
    slot's previous strength, and the next activation works."""
    from lora_engine import plan
    a, b, c, d = adapters
    x = lf.tiny_input()
    model = lf.tiny()
    bank = SlotBank(model, max_loras=3)
    bank.activate([(a, 0.5), (b, 0.8)])
    real, calls = plan.ModulePlan.write_factors, {"n": 0}

    def failing(self, *args):
        calls["n"] += 1
        if self.path == d.path:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, *args)

    monkeypatch.setattr(plan.ModulePlan, "write_factors", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        bank.activate([(b, 0.3), (c, 1.0), (d, -0.7)])  # a leaves, c takes a's slot, d fails
    assert calls["n"] > 1 and bank.slots[0] is c
    assert torch.allclose(run(model, x), solo([(b, 0.8)], x), atol=TOL)
    monkeypatch.setattr(plan.ModulePlan, "write_factors", real)
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


def test_a_refused_newcomer_of_a_higher_rank_leaves_the_output_bit_for_bit(tmp_path, monkeypatch):
    """A newcomer of a higher rank reallocates the layers' buffers before a later layer of it fails (the rebuild of
    its DoRA layer's ΔW raises, as an engine bug would: binding has refused every file that does not fit). The
    resident adapter's rows then come from a packed copy instead of the slot buffers; the copy is laid out as the
    buffers are, so that the output is the same bit for bit."""
    model = lf.tiny()
    x = lf.tiny_input()
    good = load_adapter(lf.write(tmp_path, "good.safetensors", lf.lora_tensors(model, "kohya", 7)), name="good")
    tensors = lf.lora_tensors(model, "kohya", 8, rank=8)
    tensors["lora_unet_ff.dora_scale"] = torch.ones(32, 1)  # ff: the dense path, its ΔW rebuilt at the write
    bad = load_adapter(lf.write(tmp_path, "bad.safetensors", tensors), name="bad")

    def failing_rebuild(*args, **kwargs):
        raise RuntimeError("a rebuild that fails")

    monkeypatch.setattr(bad.layers["lora_unet_ff"], "dense_delta", failing_rebuild)
    bank = SlotBank(model, max_loras=2)
    bank.activate([(good, 0.5)])
    before = run(model, x)
    with pytest.raises(EngineError, match="'ff'"):
        bank.activate([(good, 0.5), (bad, 1.0)])
    assert any(layer.rows is not None and layer.rows.packed for layer in bank.layers.values())
    assert torch.equal(run(model, x), before)
