"""Pinned adapters: packing into power-of-two host buffers, B laid out in one copy, cross-device slot writes."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from lora_engine import SlotBank, load_adapter

from .support import lora_files as lf
from .support.banks import run, solo


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
