"""The dense path (LoHa, LoKr, full diffs, DoRA): its deltas are checked in the model's dtype before any slot
changes, and made one layer at a time."""

from __future__ import annotations

import weakref

import pytest
import torch

from lora_engine import NonFiniteError, SlotBank, load_adapter
from lora_engine import plan as plan_module

from .support import lora_files as lf


def _scaled(tensors: dict[str, torch.Tensor], suffix: str, factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor if k.endswith(suffix) else v for k, v in tensors.items()}


OVERFLOWING = {  # finite in the file's fp32, past fp16's 65504 once combined
    "loha": lambda m: _scaled(lf.loha_tensors(m, 3, rank=lf.DENSE_LOHA_RANK), "hada_w1_a", 1e6),
    "lokr": lambda m: _scaled(lf.lokr_tensors(m, 3, full_w2=True, w1_rows=1), "lokr_w1", 1e6),
    "diff": lambda m: _scaled(lf.diff_tensors(m, 3), ".diff", 1e7),
    "dora": lambda m: _scaled(lf.dora_tensors(m, 3), "dora_scale", 1e6),
}


@pytest.mark.parametrize("kind", sorted(OVERFLOWING))
def test_dense_deltas_that_overflow_the_model_dtype_are_refused(tmp_path, kind):
    """A dense-path adapter whose ΔW is finite in fp32 but not in the model's fp16 is refused, naming the layer
    and the dtype, and the model computes exactly what it computed before: the adapter that was active stays."""
    model = lf.tiny().half()
    x = lf.tiny_input().half()
    good = load_adapter(lf.write(tmp_path, "good.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 1)), pin=False)
    bad = load_adapter(lf.write(tmp_path, f"{kind}.safetensors", OVERFLOWING[kind](lf.tiny())), pin=False)
    bank = SlotBank(model, max_loras=1)
    bank.activate([(good, 0.5)])
    with torch.no_grad():
        before = model(x)
    with pytest.raises(NonFiniteError, match=r"dense delta of layer '.+' is not finite in torch.float16") as e:
        bank.activate([(bad, 1.0)])
    assert e.value.path == bad.path
    assert bank.slots == [good]
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_a_bound_past_the_dtype_with_finite_deltas_is_computed_and_kept(tmp_path):
    """The bound from the factors' maxima can exceed the dtype where the products do not (large entries that never
    meet): ΔW is then computed to decide, and the adapter is applied as any other."""
    model = lf.tiny().half()
    t = lf.loha_tensors(lf.tiny(), 4, rank=lf.DENSE_LOHA_RANK)
    for k in [k for k in t if k.endswith("hada_w1_a")]:
        t[k][0, 0] = 300.0  # meets w1_b row 0, which stays small
    for k in [k for k in t if k.endswith("hada_w1_b")]:
        t[k][1, 0] = 300.0  # meets w1_a column 1, which stays small
    adapter = load_adapter(lf.write(tmp_path, "wide.safetensors", t), pin=False)
    bank = SlotBank(model, max_loras=1)
    assert not any(p.bounded(torch.float16) for p in bank.binding(adapter).plans.values())
    bank.activate([(adapter, 1.0)])
    assert bank.slots == [adapter]
    for name, layer in bank.layers.items():
        plan = bank.binding(adapter).plans[name]
        assert torch.equal(layer.dense[0], plan.dense(None).to(torch.float16)), name


def test_dense_deltas_are_made_one_layer_at_a_time(tmp_path, monkeypatch):
    """Activating a dense-path adapter never holds the fp32 deltas of two layers at once: each one is converted into
    its slot and dropped before the next is made (all of them at once would be the model's size again, in fp32)."""
    model = lf.tiny().to(torch.bfloat16)
    adapter = load_adapter(lf.write(tmp_path, "h.safetensors", lf.loha_tensors(lf.tiny(), 5, rank=lf.DENSE_LOHA_RANK)),
                           pin=False)
    made, real = [], plan_module.ModulePlan.dense

    def dense(self, *args):
        assert all(r() is None for r in made), "an earlier layer's fp32 delta is still held"
        out = real(self, *args)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(plan_module.ModulePlan, "dense", dense)
    bank = SlotBank(model, max_loras=1)
    bank.activate([(adapter, 1.0)])
    assert len(made) == len(lf.LAYERS) == sum(bool(layer.dense) for layer in bank.layers.values())


def _modules(model) -> dict[str, torch.nn.Module]:
    mods = dict(model.named_modules())
    return {name: mods[name] for name in lf.LAYERS}


def _set_weights(model, weights: dict[str, torch.Tensor], replace: bool) -> None:
    """Put `weights` on `model` as a host does: a new parameter per layer (`replace`), or copied into the one held."""
    for name, m in _modules(model).items():
        if replace:
            m.weight = weights[name] if isinstance(weights[name], torch.nn.Parameter) else \
                torch.nn.Parameter(weights[name].clone(), requires_grad=False)
        else:
            with torch.no_grad():
                m.weight.copy_(weights[name])


@pytest.mark.parametrize("kind", ["dora", "oft"])
@pytest.mark.parametrize("how", ["replaced", "in_place"])
def test_a_weight_reading_adapter_follows_the_weights_the_host_swaps(tmp_path, kind, how):
    """An adapter whose ΔW reads the layer's weight (DoRA, OFT), activated while a host holds other weights on the
    model (a merge loaded with the stack, patching the weights in place) and activated again after the host put the
    original weights back, computes what a fresh model with those weights computes: its slots are written again
    from the weights it now reads, not kept from the ones it read before."""
    tensors = lf.dora_tensors(lf.tiny(), 4) if kind == "dora" else lf.oft_tensors(lf.tiny(), 4)
    adapter = load_adapter(lf.write(tmp_path, f"{kind}.safetensors", tensors), pin=False)
    x = lf.tiny_input()
    model = lf.tiny()
    original = {name: m.weight for name, m in _modules(model).items()}
    g = torch.Generator().manual_seed(9)
    other = {name: w.detach() + 0.2 * torch.randn(w.shape, generator=g) for name, w in original.items()}
    bank = SlotBank(model, max_loras=1)

    def fresh(weights) -> torch.Tensor:
        m = lf.tiny()
        _set_weights(m, weights, replace=True)
        b = SlotBank(m, max_loras=1)
        b.activate([(adapter, 0.8)])
        with torch.no_grad():
            out = m(x)
        b.release()
        return out

    want_original, want_other = fresh({n: w.detach() for n, w in original.items()}), fresh(other)
    assert not torch.allclose(want_original, want_other)  # the weights read change the output
    bank.activate([(adapter, 0.8)])
    backup = {n: w.detach().clone() for n, w in original.items()}
    _set_weights(model, other, replace=how == "replaced")  # the host patches the weights
    bank.activate([(adapter, 0.8)])
    with torch.no_grad():
        assert torch.equal(model(x), want_other)
    _set_weights(model, original if how == "replaced" else backup, replace=how == "replaced")  # and restores them
    bank.activate([(adapter, 0.8)])
    with torch.no_grad():
        assert torch.equal(model(x), want_original)
    bank.release()


def test_a_weight_reading_adapter_on_inference_tensors(tmp_path):
    """Weights made under `torch.inference_mode` (as a host may load them) keep no version counter: a DoRA adapter
    activates on them, and again after they are replaced, with the output of a fresh model holding the new ones."""
    adapter = load_adapter(lf.write(tmp_path, "dora.safetensors", lf.dora_tensors(lf.tiny(), 4)), pin=False)
    x = lf.tiny_input()

    def inference_weights(model, seed: int) -> dict[str, torch.nn.Parameter]:
        g = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            return {n: torch.nn.Parameter(m.weight.detach() + 0.1 * torch.randn(m.weight.shape, generator=g),
                                          requires_grad=False) for n, m in _modules(model).items()}

    def output(model, bank, weights) -> torch.Tensor:
        _set_weights(model, weights, replace=True)
        bank.activate([(adapter, 0.7)])
        with torch.inference_mode():
            return model(x)

    def fresh(weights) -> torch.Tensor:
        m = lf.tiny()
        return output(m, SlotBank(m, max_loras=1), weights)

    model = lf.tiny()
    bank = SlotBank(model, max_loras=1)
    first, second = inference_weights(model, 1), inference_weights(model, 2)
    assert torch.equal(output(model, bank, first), fresh(first))
    assert torch.equal(output(model, bank, second), fresh(second))
