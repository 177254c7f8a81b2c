"""The dense path (LoHa, LoKr, full diffs, DoRA): its deltas are checked in the model's dtype before any slot
changes, and made one layer at a time."""

from __future__ import annotations

import weakref

import pytest
import torch

from lora_engine import NonFiniteError, SlotBank, load_adapter
from lora_engine import binding as binding_module

from . import lora_files as lf


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
    made, real = [], binding_module.ModulePlan.dense

    def dense(self, *args):
        assert all(r() is None for r in made), "an earlier layer's fp32 delta is still held"
        out = real(self, *args)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(binding_module.ModulePlan, "dense", dense)
    bank = SlotBank(model, max_loras=1)
    bank.activate([(adapter, 1.0)])
    assert len(made) == len(lf.LAYERS) == sum(bool(layer.dense) for layer in bank.layers.values())
