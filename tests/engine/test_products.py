"""LoHa and LoKr products as exact low-rank adapters: a layer whose product has a low-rank form with fewer elements
than ΔW runs it in the low-rank slots (two small GEMMs, no ΔW on the device). A LoKr on a Linear without such a form
is applied as its two factors (`runtime.Kron`); the others take the dense path."""

from __future__ import annotations

import pytest
import torch

from lora_engine import NonFiniteError, SlotBank, load_adapter
from lora_engine.runtime import Kron

from .support import lora_files as lf

TOL = 1e-5


def kron_reference(w1: torch.Tensor, w2: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """kron(W1, W2) for a layer of `shape`, written as ΔW[(i,k), (j,l)] = W1[i,j]·W2[k,l] with W2 read as
    [out / a, in / b, *kernel], in float64."""
    a, b = w1.shape
    w2 = w2.double().reshape(shape[0] // a, shape[1] // b, -1)
    d = torch.einsum("ij,klh->ikjlh", w1.double(), w2)
    return d.reshape(shape[0], shape[1], *shape[2:])


def lokr_low_rank_w1(model, seed: int, w2_rank: int | None = None, alpha: float = 0.5
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """LoKr with w1 as a low-rank pair of rank 1 (lokr_w1_a, lokr_w1_b; alpha/rank applies) and a full w2, or with
    `w2_rank` a low-rank w2 of that rank (alpha over its rank); and its ΔW per layer."""
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name, shape in lf.weight_shapes(model).items():
        o, i = shape[0], shape[1]
        a, b = (2 if o % 2 == 0 else 1), (2 if i % 2 == 0 else 1)
        p = "lora_unet_" + name.replace(".", "_")
        w1a, w1b = torch.randn(a, 1, generator=g), torch.randn(1, b, generator=g)
        tensors.update({f"{p}.lokr_w1_a": w1a, f"{p}.lokr_w1_b": w1b, f"{p}.alpha": torch.tensor(alpha)})
        if w2_rank is None:
            w2 = torch.randn(o // a, i // b, *shape[2:], generator=g) * 0.3
            tensors[f"{p}.lokr_w2"] = w2
        else:
            w2a = torch.randn(o // a, w2_rank, generator=g) * 0.3
            w2b = torch.randn(w2_rank, (i // b) * shape[2:].numel(), generator=g)
            tensors.update({f"{p}.lokr_w2_a": w2a, f"{p}.lokr_w2_b": w2b})
            w2 = w2a @ w2b
        deltas[name] = kron_reference(w1a @ w1b, w2, shape) * (alpha / (w2_rank or 1))
    return tensors, deltas


def run(model, x):
    with torch.no_grad():
        return model(x)


def fused(deltas: dict[str, torch.Tensor], strength: float):
    """The tiny model with `strength`·ΔW added to its weights in float64, rounded once."""
    ref = lf.tiny()
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name, d in deltas.items():
            w = mods[name].weight
            w.copy_((w.double() + strength * d).to(w.dtype))
    return ref


def test_a_lokr_with_a_low_rank_w1_equals_its_kronecker_product(tmp_path):
    """The third LoKr layout (w1 as two factors, w2 full): its product has rank 1·min(w2's sides), which runs
    low-rank where that is fewer elements than ΔW (conv_in 3·(27+6) < 6·27; not to_q, 8·(16+16) = 16·16), and the
    output is the base model's with kron(W1, W2) added, by explicit indexing."""
    model, x = lf.tiny(), lf.tiny_input()
    tensors, deltas = lokr_low_rank_w1(model, 3)
    adapter = load_adapter(lf.write(tmp_path, "lokr.safetensors", tensors), pin=False)
    bank = SlotBank(model, max_loras=1)
    plans = bank.binding(adapter).plans
    assert {n: p.rank for n, p in plans.items() if p.low_rank} == {"conv_in": 3, "conv_mid": 3, "proj": 8, "ff": 8}
    bank.activate([(adapter, 0.8)])
    assert {n for n, layer in bank.layers.items() if layer.dense} == {"attn.to_q", "attn.to_out.0", "head"}
    expected = run(fused(deltas, 0.8), x)
    assert (run(model, x) - expected).abs().max() <= TOL
    assert (expected - run(lf.tiny(), x)).abs().max() > 1e-2


def test_a_lokr_whose_factors_have_different_ranks_takes_alpha_over_w2s(tmp_path):
    """Both factors low-rank, of ranks 1 and 2 (LyCORIS writes one rank for both): alpha / rank(w2), as ComfyUI's
    LoraLoader reads it; alpha / rank(w1) would double the delta."""
    model, x = lf.tiny(), lf.tiny_input()
    tensors, deltas = lokr_low_rank_w1(model, 4, w2_rank=2, alpha=1.0)
    adapter = load_adapter(lf.write(tmp_path, "lokr.safetensors", tensors), pin=False)
    SlotBank(model, max_loras=1).activate([(adapter, 0.8)])
    expected = run(fused(deltas, 0.8), x)
    assert (run(model, x) - expected).abs().max() <= TOL
    assert (expected - run(lf.tiny(), x)).abs().max() > 1e-2


def test_the_product_runs_low_rank_only_where_its_factors_are_smaller_than_the_delta(tmp_path):
    """A rank-3 LoHa has a product of rank 9: fewer elements than ΔW on proj (96→16) and ff (16→32), more on the
    others, which take the dense path. Both paths together equal the dense deltas."""
    model, x = lf.tiny(), lf.tiny_input()
    adapter = load_adapter(lf.write(tmp_path, "loha.safetensors", lf.loha_tensors(model, 4, rank=3)), pin=False)
    bank = SlotBank(model, max_loras=1)
    plans = bank.binding(adapter).plans
    assert {n for n, p in plans.items() if p.low_rank} == {"proj", "ff"}
    assert all(p.rank == 9 for p in plans.values() if p.low_rank)
    deltas = {n: p.dense(None).double() for n, p in plans.items()}
    bank.activate([(adapter, -0.6)])
    assert {n for n, layer in bank.layers.items() if layer.dense} == {"conv_in", "conv_mid", "attn.to_q",
                                                                     "attn.to_out.0", "head"}
    assert (run(model, x) - run(fused(deltas, -0.6), x)).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_slots_hold_the_factors_not_the_delta(tmp_path, dtype):
    """A rank-2 LoHa on the tiny model: its slots hold B and A of rank 4 on every layer, no ΔW, and each layer's
    B·A is its ΔW rounded once into the slots' dtype; the bytes copied are the factors'."""
    model = lf.tiny().to(dtype)
    adapter = load_adapter(lf.write(tmp_path, "loha.safetensors", lf.loha_tensors(lf.tiny(), 5)), pin=False)
    bank = SlotBank(model, max_loras=1)
    activation = bank.activate([(adapter, 1.0)])
    plans = bank.binding(adapter).plans
    expected_bytes = 0
    for name, layer in bank.layers.items():
        a, b = layer.slot(0)
        assert not layer.dense and a.shape[0] == 4, name
        product = b.double() @ a.reshape(4, -1).double()
        delta = plans[name].dense(None).double().reshape(product.shape)
        assert (product - delta).abs().max() <= 4 * torch.finfo(dtype).eps * delta.abs().max(), name
        expected_bytes += (a.numel() + b.numel()) * a.element_size()
    assert activation.bytes_copied == expected_bytes
    dense_bytes = sum(p.geometry.weight_shape.numel() * torch.finfo(dtype).bits // 8 for p in plans.values())
    assert expected_bytes < dense_bytes


def test_factors_that_overflow_the_model_dtype_are_refused(tmp_path):
    """A product whose factors are finite in the file but not in the model's fp16 is refused before any slot
    changes, naming the layer; the adapter that was active stays, and the model computes what it computed."""
    model, x = lf.tiny().half(), lf.tiny_input().half()
    good = load_adapter(lf.write(tmp_path, "good.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 1)), pin=False)
    t = {k: v * 1e15 if k.endswith("hada_w1_a") else v for k, v in lf.loha_tensors(lf.tiny(), 3).items()}
    bad = load_adapter(lf.write(tmp_path, "bad.safetensors", t), pin=False)
    bank = SlotBank(model, max_loras=1)
    bank.activate([(good, 0.5)])
    before = run(model, x)
    with pytest.raises(NonFiniteError, match=r"the factors of layer '.+' are not finite in torch.float16") as e:
        bank.activate([(bad, 1.0)])
    assert e.value.path == bad.path and bank.slots == [good]
    assert torch.equal(run(model, x), before)


# The same ΔW, one factor of each product scaled up by 2^20 and its partner down: W1a·W2a (B) and W·A1 pass fp16's
# range, their products with W1b·W2b and A2 do not.
SCALED = {"loha": (lambda m: lf.loha_tensors(m, 3), ("hada_w1_a", "hada_w1_b")),
          "glora": (lambda m: lf.glora_tensors(m, 4), (".a1.weight", ".a2.weight"))}


@pytest.mark.parametrize("layout", SCALED)
def test_factors_past_the_dtype_whose_products_fit_are_applied(tmp_path, layout):
    """Each rank's row of A and column of B are scaled by a power of two toward equal maxima where a factor passes
    the slots' range: the layer computes the file's ΔW, as the same file with unscaled factors does."""
    make, (up, down) = SCALED[layout]
    x = lf.tiny_input().half()
    t = make(lf.tiny())
    scaled = {k: v * 2.0**20 if k.endswith(up) else v / 2.0**20 if k.endswith(down) else v for k, v in t.items()}
    outputs = []
    for name, tensors in (("plain", t), ("scaled", scaled)):
        model = lf.tiny().half()
        bank = SlotBank(model, max_loras=1)
        bank.activate([(load_adapter(lf.write(tmp_path, f"{name}.safetensors", tensors), pin=False), 0.7)])
        # low-rank on every layer (a GLoRA's convs mix their channels per kernel position: the dense path)
        assert not any(layer.dense for name, layer in bank.layers.items() if layout == "loha" or "conv" not in name)
        outputs.append(run(model, x))
    assert torch.isfinite(outputs[1]).all()
    assert (outputs[1].float() - outputs[0].float()).abs().max() <= 1e-2 * outputs[0].float().abs().max()


def test_a_bound_past_the_dtype_with_finite_factors_is_kept(tmp_path):
    """The bound from the stored maxima can exceed fp16 where the products do not (large entries of W1a and W2a
    in different rows): the factors are then built to decide, and the adapter is applied."""
    model = lf.tiny().half()
    t = lf.loha_tensors(lf.tiny(), 6)
    for k in [k for k in t if k.endswith("hada_w1_a")]:
        t[k][0, 0] = 400.0
    for k in [k for k in t if k.endswith("hada_w2_a")]:
        t[k][1, 0] = 400.0
    adapter = load_adapter(lf.write(tmp_path, "wide.safetensors", t), pin=False)
    bank = SlotBank(model, max_loras=1)
    plans = bank.binding(adapter).plans
    assert all(max(p.pieces[0].patch.weight.factor_bounds()) > torch.finfo(torch.float16).max
               for p in plans.values())
    bank.activate([(adapter, 1.0)])
    assert bank.slots == [adapter] and all(not layer.dense for layer in bank.layers.values())


class Projections(torch.nn.Module):
    """A fused qkv Linear (8 → 24) and an output Linear (64 → 96), with nothing else."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(64, 96)

    def forward(self, x):
        return self.qkv(x[..., :8]), self.out(x)


def kron_lokr(g, a: int, b: int, c: int, d: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A LoKr's full factors w1 [a, b] and w2 [c, d] (no alpha: LyCORIS's full-dimension LoKr), times `scale`."""
    return {"lokr_w1": torch.randn(a, b, generator=g) * scale, "lokr_w2": torch.randn(c, d, generator=g) * 0.3}


def test_a_lokr_of_full_factors_on_a_linear_is_applied_as_its_two_factors(tmp_path):
    """kron(w1 [4, 4], w2 [24, 16]) on a 64 → 96 Linear has rank 64, no smaller than ΔW: the layer holds the two
    factors (400 values, against 6144 of ΔW) and adds W1 · X · W2ᵀ. The fused qkv Linear takes three LoKr on its
    slices (q, k, v as a host's map sends them), a fourth file only q and v. Each equals the explicit Kronecker
    product added to the weights; per-item strengths, and autograd on, compute the same."""
    from lora_engine import KeyMap
    g = torch.Generator().manual_seed(5)
    model, x = Projections(), torch.randn(3, 5, 64, generator=g)
    tensors = {f"out.{k}": v for k, v in kron_lokr(g, 4, 4, 24, 16).items()}
    mapping = {"out": "out.weight"}
    for j, part in enumerate("qkv"):
        tensors.update({f"to_{part}.{k}": v for k, v in kron_lokr(g, 2, 2, 4, 4).items()})
        mapping[f"to_{part}"] = ("qkv.weight", (0, 8 * j, 8))
    partial = {k: v for k, v in tensors.items() if k.startswith(("to_q.", "to_v."))}
    full = load_adapter(lf.write(tmp_path, "lokr.safetensors", tensors), pin=False)
    qv = load_adapter(lf.write(tmp_path, "qv.safetensors", partial), pin=False)
    bank = SlotBank(model, max_loras=2, keymap=KeyMap(model, mapping, defaults=False))
    assert all(p.kron and not p.low_rank for p in bank.binding(full).plans.values())
    assert bank.report(full).runtime_path == "kronecker"

    def expected(strengths):
        ref = Projections()
        with torch.no_grad():
            for adapter_tensors, s in strengths:
                if "out.lokr_w1" in adapter_tensors:
                    ref.out.weight += s * kron_reference(adapter_tensors["out.lokr_w1"],
                                                         adapter_tensors["out.lokr_w2"], ref.out.weight.shape)
                for j, part in enumerate("qkv"):
                    if f"to_{part}.lokr_w1" in adapter_tensors:
                        ref.qkv.weight[8 * j:8 * (j + 1)] += s * kron_reference(
                            adapter_tensors[f"to_{part}.lokr_w1"], adapter_tensors[f"to_{part}.lokr_w2"],
                            torch.Size((8, 8)))
            return ref(x)

    bank.activate([(full, 0.7), (qv, -0.5)])
    layer = bank.layers["out"]
    assert isinstance(layer.dense[0], Kron) and layer.nbytes() == (16 + 24 * 16) * 4
    with torch.no_grad():
        got = model(x)
    with torch.enable_grad():
        graded = model(x)
    want = expected([(tensors, 0.7), (partial, -0.5)])
    for g_, w_, a_ in zip(got, want, graded):
        assert (g_ - w_).abs().max() <= TOL and (a_.detach() - w_).abs().max() <= TOL
    assert (want[1] - Projections()(x)[1]).abs().max() > 1e-1

    bank.activate([(full, [0.7, 0.0, -1.0]), (qv, 0.25)])
    with torch.no_grad():
        items = model(x)
    for i, s in enumerate([0.7, 0.0, -1.0]):
        one = expected([(tensors, s), (partial, 0.25)])
        assert all((items[k][i] - one[k][i]).abs().max() <= TOL for k in range(2)), i


def test_kronecker_factors_that_overflow_the_model_dtype_are_refused(tmp_path):
    """The factors are checked in the model's dtype before any slot changes, naming the layer."""
    g = torch.Generator().manual_seed(6)
    model = Projections().half()
    tensors = {f"out.{k}": v for k, v in kron_lokr(g, 4, 4, 24, 16, scale=1e6).items()}
    from lora_engine import KeyMap
    bad = load_adapter(lf.write(tmp_path, "big.safetensors", tensors), pin=False)
    bank = SlotBank(model, max_loras=1, keymap=KeyMap(model, {"out": "out.weight"}, defaults=False))
    with pytest.raises(NonFiniteError, match=r"the Kronecker factors of layer 'out' are not finite in torch.float16"):
        bank.activate([(bad, 1.0)])
    assert bank.slots == [None] and not bank.layers


def test_kronecker_halves_past_the_dtype_whose_product_fits_are_applied(tmp_path):
    """W1 × 2²⁰ and W2 / 2²⁰ pass fp16's range one by one while kron(W1, W2) does not: the two halves are scaled
    by one power of two toward equal maxima, and the layer computes the same output as the unscaled file."""
    from lora_engine import KeyMap
    g = torch.Generator().manual_seed(7)
    plain = {f"out.{k}": v for k, v in kron_lokr(g, 4, 4, 24, 16).items()}
    scaled = {k: v * 2.0**20 if k.endswith("w1") else v / 2.0**20 for k, v in plain.items()}
    assert scaled["out.lokr_w1"].abs().max() > torch.finfo(torch.float16).max
    x = torch.randn(3, 5, 64, generator=g).half()
    outputs = []
    for name, tensors in (("plain", plain), ("scaled", scaled)):
        model = Projections().half()
        bank = SlotBank(model, max_loras=1, keymap=KeyMap(model, {"out": "out.weight"}, defaults=False))
        bank.activate([(load_adapter(lf.write(tmp_path, f"{name}.safetensors", tensors), pin=False), 0.7)])
        assert isinstance(bank.layers["out"].dense[0], Kron)
        outputs.append(run(model, x)[1].float())
    assert torch.isfinite(outputs[1]).all()
    assert (outputs[1] - outputs[0]).abs().max() <= 1e-2 * outputs[0].abs().max()
    assert (outputs[0] - run(Projections().half(), x)[1].float()).abs().max() > 1e-1
