"""Activation rules: set semantics, warm slots, limits, shared bases, dtypes, release."""

from __future__ import annotations

import pytest
import torch

from lora_engine import Entry, NonFiniteError, SlotBank, SlotLimitError, load_adapter

from .support import lora_files as lf
from .support.banks import TOL, four_adapters, run, solo


@pytest.fixture
def adapters(tmp_path):
    return four_adapters(tmp_path)


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
    assert bank.owner.dtype == torch.bfloat16
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
    assert bank.owner.reallocations == len(shapes)


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
    bank.owner.release_when_idle = lambda: (released.append(True), bank.release())
    with_stack = run(model, x)
    assert not released and (with_stack - solo([(adapters[0], 1.0)], x)).abs().max() <= TOL
    bank.deactivate()
    bank.activate([(adapters[0], 0.5)])
    bank.deactivate()
    run(model, x)
    assert not released  # the activation cancelled it
    bank.owner.release_when_idle = lambda: (released.append(True), bank.release())
    base = run(model, x)
    assert released == [True] and not bank.layers and not any(m._forward_hooks for m in model.modules())
    assert (base - solo([], x)).abs().max() == 0
