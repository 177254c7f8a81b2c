"""Oracle test: the runtime engine against diffusers + PEFT on tiny random diffusers models.

Acceptance criterion: on a tiny `UNet2DConditionModel` and a tiny `FluxTransformer2DModel` (small configs,
random weights, fp32), three adapters stored as a kohya, a PEFT and an old-diffusers file and applied at
strengths 0.8, -0.5 and 1.2 give the same output as diffusers/PEFT (`load_lora_adapter`, then `set_adapters`
with those weights, on the PEFT equivalents of the same adapters): max abs diff <= 1e-5.

How the oracle is built, per model:

1. The base model is built from a small config under a fixed seed, and its output on fixed inputs recorded.
2. Three random LoRAs are drawn (random A, nonzero random B; ranks 4, 8 and 6; two of them with
   lora_alpha != rank, so alpha/rank scaling is exercised). Together they cover attention projections
   (`to_out` included), feed-forward layers, 1x1 and 3x3 convolutions and embedding/norm linears; every
   attention projection is covered by more than one adapter, so the engine's slot sums are exercised too.
3. Reference: a deep copy of the base gets each LoRA as a PEFT state dict via `load_lora_adapter` (with an
   explicit `LoraConfig` as metadata, so r / lora_alpha / targets are exactly what we mean), then
   `set_adapters(names, weights=[0.8, -0.5, 1.2])`. PEFT computes base(x) + Σ w·(lora_alpha/r)·B(A(x)).
4. Engine: another deep copy of the untouched base, the same LoRAs written to disk in the three layouts,
   `load_adapter` + `SlotBank.activate` at the same strengths.

The files carry alpha the way the engine reads it (`<prefix>.alpha`, scale = alpha / rank, which is PEFT's
lora_alpha / r): the kohya file has an `.alpha` key on every layer (0-dim as kohya writes it, every other
one 1-element), the PEFT file has one because its lora_alpha != r, and the old-diffusers file has none
(attention-processor files never stored alpha), so that adapter's lora_alpha equals its rank.

Helpers that write the layouts live in this file on purpose (see `write_kohya`, `write_peft`,
`write_diffusers_old`); they are pure functions of (factors, prefix) -> safetensors file.
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# `load_lora_adapter(..., metadata=LoraConfig kwargs)` arrived in diffusers 0.34 (huggingface/diffusers#11324).
diffusers = pytest.importorskip("diffusers", minversion="0.34")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from peft.tuners.lora import LoraLayer  # noqa: E402

from lora_engine import SlotBank, load_adapter  # noqa: E402

STRENGTHS = (0.8, -0.5, 1.2)
TOL = 1e-5
# Each adapter alone must move the output by far more than the tolerance, or the test could pass vacuously.
MIN_EFFECT = 1e-2

# -- the LoRA factors ------------------------------------------------------------------------------------

# One LoRA as plain tensors: module path -> (A [r, in, *k], B [out, r, *1]) in PEFT's own shapes.
Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdapterSpec:
    name: str  # PEFT adapter name and file stem
    layout: str  # "kohya" | "peft" | "diffusers-old"
    rank: int
    alpha: float | None  # None: no alpha is stored anywhere; PEFT gets lora_alpha = rank (scale 1)
    targets: str  # regex, fullmatched against module paths of Linear / Conv2d layers

    @property
    def lora_alpha(self) -> float:
        return float(self.rank) if self.alpha is None else float(self.alpha)


def target_modules(model: nn.Module, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and rx.fullmatch(n)]


def random_factors(model: nn.Module, spec: AdapterSpec, seed: int) -> Factors:
    """A random LoRA for the modules `spec.targets` selects; B is nonzero (unlike a fresh PEFT init)."""
    g = torch.Generator().manual_seed(seed)
    out: Factors = {}
    for name in target_modules(model, spec.targets):
        w = model.get_submodule(name).weight
        fan_in = w[0].numel()
        a = torch.randn((spec.rank, *w.shape[1:]), generator=g) / math.sqrt(fan_in)
        b = torch.randn((w.shape[0], spec.rank, *[1] * (w.dim() - 2)), generator=g) * (0.5 / math.sqrt(spec.rank))
        out[name] = (a.contiguous(), b.contiguous())
    assert out, f"adapter {spec.name!r} selects no module with {spec.targets!r}"
    return out


# -- writers for the three file layouts ------------------------------------------------------------------

def _alpha_tensor(alpha: float, i: int = 0) -> torch.Tensor:
    """0-dim, as kohya's sd-scripts writes it; every other layer a 1-element tensor, as some converters do."""
    t = torch.tensor(alpha, dtype=torch.float32)
    return t if i % 2 == 0 else t.reshape(1)


def write_kohya(path: str, factors: Factors, alpha: float | None, kohya_prefix: str = "lora_unet_") -> str:
    """`lora_unet_<module path with . -> _>.lora_down.weight` / `.lora_up.weight` / `.alpha`."""
    sd = {}
    for i, (name, (a, b)) in enumerate(factors.items()):
        key = kohya_prefix + name.replace(".", "_")
        sd[f"{key}.lora_down.weight"] = a
        sd[f"{key}.lora_up.weight"] = b
        if alpha is not None:
            sd[f"{key}.alpha"] = _alpha_tensor(alpha, i)
    safetensors_torch.save_file(sd, path)
    return path


def write_peft(path: str, factors: Factors, alpha: float | None, rank: int, prefix: str = "unet") -> str:
    """`<prefix>.<module>.lora_A.weight` / `.lora_B.weight`; `<prefix>.<module>.alpha` only when alpha != rank."""
    sd = {}
    for name, (a, b) in factors.items():
        sd[f"{prefix}.{name}.lora_A.weight"] = a
        sd[f"{prefix}.{name}.lora_B.weight"] = b
        if alpha is not None and float(alpha) != float(rank):
            sd[f"{prefix}.{name}.alpha"] = _alpha_tensor(alpha)
    safetensors_torch.save_file(sd, path)
    return path


# Projections an old diffusers attention processor (LoRAAttnProcessor / LoRAAttnAddedKVProcessor) carried.
_OLD_PROCESSOR = re.compile(r"(?P<attn>.*\.attn\d?)\.(?P<proj>to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)")


def old_diffusers_key(prefix: str, name: str) -> str:
    """The `.down.weight`-less key stem of one layer in old diffusers layout."""
    m = _OLD_PROCESSOR.fullmatch(name)
    if m:
        proj = "to_out" if m["proj"] == "to_out.0" else m["proj"]
        return f"{prefix}.{m['attn']}.processor.{proj}_lora"
    return f"{prefix}.{name}.lora"  # LoRACompatibleLinear / LoRACompatibleConv


def write_diffusers_old(path: str, factors: Factors, prefix: str = "unet") -> str:
    """Attention layers as `<attn>.processor.to_q_lora.down.weight` (`to_out_lora` for `to_out.0`); every
    other layer as `<module>.lora.down.weight`. No alpha: these files never stored one."""
    sd = {}
    for name, (a, b) in factors.items():
        stem = old_diffusers_key(prefix, name)
        sd[f"{stem}.down.weight"] = a
        sd[f"{stem}.up.weight"] = b
    safetensors_torch.save_file(sd, path)
    return path


# -- model cases -----------------------------------------------------------------------------------------

def _build_unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)


def _unet_inputs(g: torch.Generator) -> dict:
    return {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10.0, 500.0]),
            "encoder_hidden_states": torch.randn(2, 7, 32, generator=g)}


def _build_flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 4, 8))


def _flux_inputs(g: torch.Generator) -> dict:
    h = w = 4
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {"hidden_states": torch.randn(2, h * w, 16, generator=g),
            "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
            "pooled_projections": torch.randn(2, 32, generator=g),
            "timestep": torch.tensor([0.25, 0.75]),
            "img_ids": img_ids.reshape(h * w, 3), "txt_ids": torch.zeros(6, 3)}


@dataclass(frozen=True)
class ModelCase:
    id: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], dict]
    prefix: str  # the model part in dotted file keys
    kohya_prefix: str
    adapters: tuple[AdapterSpec, AdapterSpec, AdapterSpec]


_ATTN = r".*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)"

CASES = (
    ModelCase(
        "unet", _build_unet, _unet_inputs, "unet", "lora_unet_",
        (
            # kohya: attention, 3x3 resnet convs, conv_in, time_emb_proj; alpha 3 on rank 4 -> scale 0.75
            AdapterSpec("kohya", "kohya", 4, 3.0,
                        rf"{_ATTN}|.*resnets\.\d+\.conv1|conv_in|.*resnets\.\d+\.time_emb_proj"),
            # PEFT: self-attention, feed-forward, 1x1 proj_in, 3x3 conv2, a time-embedding linear; 16 / 8 -> 2
            AdapterSpec("peft", "peft", 8, 16.0,
                        r".*\.attn1\.(to_q|to_k|to_v|to_out\.0)|.*\.ff\.net\.(0\.proj|2)|.*\.proj_in"
                        r"|.*resnets\.\d+\.conv2|time_embedding\.linear_1"),
            # old diffusers: every attention projection through `processor.*_lora`, plus proj_out,
            # 1x1 conv_shortcut, ff.net.2 and conv_out through `.lora.`; no alpha (scale 1)
            AdapterSpec("diffusers_old", "diffusers-old", 6, None,
                        rf"{_ATTN}|.*\.proj_out|.*conv_shortcut|.*\.ff\.net\.2|conv_out"),
        ),
    ),
    ModelCase(
        "flux", _build_flux, _flux_inputs, "transformer", "lora_transformer_",
        (
            AdapterSpec("kohya", "kohya", 4, 3.0,
                        r".*\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                        r"|single_transformer_blocks\.\d+\.(proj_mlp|proj_out)"),
            AdapterSpec("peft", "peft", 8, 16.0,
                        r".*\.attn\.(to_q|to_k|to_v)|.*\.ff(_context)?\.net\.(0\.proj|2)|.*\.norm1\.linear"
                        r"|x_embedder|context_embedder"),
            AdapterSpec("diffusers_old", "diffusers-old", 6, None,
                        r".*\.attn\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)|proj_out|norm_out\.linear"
                        r"|single_transformer_blocks\.\d+\.proj_mlp|time_text_embed\.timestep_embedder\.linear_1"),
        ),
    ),
)


# -- helpers ---------------------------------------------------------------------------------------------

def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].detach().clone()


def max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max())


def load_reference_adapter(model: nn.Module, spec: AdapterSpec, factors: Factors) -> None:
    """diffusers' `load_lora_adapter` with a PEFT state dict and an explicit LoraConfig, then a check that
    PEFT holds exactly these factors at scale lora_alpha / r (so the oracle is what we think it is)."""
    sd = {}
    for name, (a, b) in factors.items():
        sd[f"{name}.lora_A.weight"] = a.clone()
        sd[f"{name}.lora_B.weight"] = b.clone()
    config = {"r": spec.rank, "lora_alpha": spec.lora_alpha, "lora_dropout": 0.0,
              "target_modules": "^(?:" + "|".join(re.escape(n) for n in factors) + ")$"}
    model.load_lora_adapter(sd, adapter_name=spec.name, prefix=None, metadata=config)
    held = {n for n, m in model.named_modules() if isinstance(m, LoraLayer) and spec.name in m.lora_A}
    assert held == set(factors), f"PEFT injected {spec.name!r} into {sorted(held ^ set(factors))} unexpectedly"
    for name, (a, b) in factors.items():
        layer = model.get_submodule(name)
        assert torch.equal(layer.lora_A[spec.name].weight, a), name
        assert torch.equal(layer.lora_B[spec.name].weight, b), name
        assert layer.scaling[spec.name] == pytest.approx(spec.lora_alpha / spec.rank), name


def write_adapter(tmp_path, case: ModelCase, spec: AdapterSpec, factors: Factors) -> str:
    path = str(tmp_path / f"{case.id}_{spec.name}.safetensors")
    if spec.layout == "kohya":
        return write_kohya(path, factors, spec.alpha, case.kohya_prefix)
    if spec.layout == "peft":
        return write_peft(path, factors, spec.alpha, spec.rank, case.prefix)
    if spec.layout == "diffusers-old":
        assert spec.alpha is None, "old diffusers files carry no alpha"
        return write_diffusers_old(path, factors, case.prefix)
    raise AssertionError(spec.layout)


EXPECTED_FORMATS = {"kohya": {"kohya"}, "peft": {"peft"}, "diffusers-old": {"diffusers-old", "diffusers"}}


# -- the test --------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_engine_matches_diffusers_peft(case: ModelCase, tmp_path):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        base = case.build().float().eval()
    inputs = case.inputs(torch.Generator().manual_seed(99))
    factors = [random_factors(base, spec, seed=100 + i) for i, spec in enumerate(case.adapters)]
    names = [spec.name for spec in case.adapters]
    base_out = forward(base, inputs)
    assert torch.isfinite(base_out).all() and base_out.abs().max() > 0

    # The oracle: diffusers + PEFT on a copy of the base.
    ref_model = copy.deepcopy(base)
    for spec, f in zip(case.adapters, factors):
        load_reference_adapter(ref_model, spec, f)
    ref_single = []
    for name, s in zip(names, STRENGTHS):
        ref_model.set_adapters([name], weights=[s])
        ref_single.append(forward(ref_model, inputs))
    ref_model.set_adapters(names, weights=list(STRENGTHS))
    ref_out = forward(ref_model, inputs)
    del ref_model

    # The engine: another copy of the untouched base, adapters read from files in three layouts.
    model = copy.deepcopy(base)
    adapters = [load_adapter(write_adapter(tmp_path, case, spec, f), name=spec.name)
                for spec, f in zip(case.adapters, factors)]
    bank = SlotBank(model, max_loras=3)
    for spec, a, f in zip(case.adapters, adapters, factors):
        formats = {part for f in a.formats for part in f.split("+")}  # the LoRA parser joins its variants
        assert formats == EXPECTED_FORMATS[spec.layout], (spec.name, a.formats)
        report = bank.report(a)
        assert report.unmatched == (), (spec.name, report.unmatched)
        assert report.leftover == (), (spec.name, report.leftover)
        assert report.matched == len(f), (spec.name, report.matched, len(f))
        assert report.low_rank == len(f) and report.dense == 0, (spec.name, report.line())

    bank.activate(list(zip(adapters, STRENGTHS)))
    out = forward(model, inputs)
    diff = max_diff(out, ref_out)
    print(f"\n[{case.id}] max|engine - diffusers/PEFT| = {diff:.3e} (3 adapters at {STRENGTHS}); "
          f"max|ref - base| = {max_diff(ref_out, base_out):.3e}; max|out| = {float(out.abs().max()):.3e}")
    assert diff <= TOL, f"{case.id}: engine differs from diffusers/PEFT by {diff:.3e} > {TOL}"
    assert max_diff(out, base_out) > MIN_EFFECT, "the adapters barely change the output; the test would be vacuous"

    # Each adapter alone changes the output, and still agrees with the oracle.
    for spec, a, s, ref in zip(case.adapters, adapters, STRENGTHS, ref_single):
        bank.activate([(a, s)])
        single = forward(model, inputs)
        d = max_diff(single, ref)
        print(f"[{case.id}] {spec.name} alone at {s}: max|engine - ref| = {d:.3e}, "
              f"max|out - base| = {max_diff(single, base_out):.3e}")
        assert d <= TOL, f"{case.id}/{spec.name} alone differs from diffusers/PEFT by {d:.3e}"
        assert max_diff(single, base_out) > MIN_EFFECT, f"{spec.name} alone does not change the output"

    # Back to the full stack after slots were released and refilled, then off: the base is untouched.
    bank.activate(list(zip(adapters, STRENGTHS)))
    assert max_diff(forward(model, inputs), ref_out) <= TOL
    bank.deactivate()
    assert torch.equal(forward(model, inputs), base_out), "the base model's output changed after deactivate()"
    bank.release()
