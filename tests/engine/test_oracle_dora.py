"""Oracle test: DoRA against PEFT's own DoRA layers (`LoraConfig(use_dora=True)`) on the tiny model.

PEFT keeps one magnitude per output channel: flat (`[out]`) on a Linear, `[1, out, 1, 1]` on a Conv2d,
and normalises W + ΔW. The adapter is PEFT's own state dict (`get_peft_model_state_dict`) with random
factors and magnitudes that differ from the norms, so that the decomposition matters, written as a file
and applied at strength 1, where PEFT's DoRA and ComfyUI's strength semantics meet.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lora_engine import SlotBank, load_adapter

from .support import lora_files as lf

peft = pytest.importorskip("peft")

TOL = 1e-5
ALPHA, RANK = 2.0, 3
LINEARS = ["proj", "attn.to_q", "attn.to_out.0", "ff", "head"]
CONVS = ["conv_in", "conv_mid"]  # conv_in: 3 in, 6 out, so a magnitude on the wrong axis cannot fit


def peft_dora(model: torch.nn.Module, targets: list[str], seed: int) -> tuple[torch.nn.Module, dict]:
    """A copy of `model` with PEFT DoRA layers on `targets`, and the adapter as a file's state dict."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, use_dora=True,
                             init_lora_weights=False)
    ref = peft.inject_adapter_in_model(config, copy.deepcopy(model)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in ref.modules():
            magnitudes = getattr(module, "lora_magnitude_vector", None)
            if magnitudes is not None and "default" in magnitudes:
                m = magnitudes["default"].weight
                m.mul_(0.5 + torch.rand(m.shape, generator=g))  # away from ‖W + ΔW‖, PEFT's initial value
    sd = {"unet." + k: v.detach().clone().contiguous() for k, v in peft.get_peft_model_state_dict(ref).items()}
    for key in [k for k in sd if k.endswith(".lora_A.weight")]:
        sd[key[: -len(".lora_A.weight")] + ".alpha"] = torch.tensor(ALPHA)
    return ref, sd


@pytest.mark.parametrize("targets", [LINEARS, CONVS, LINEARS + CONVS], ids=["linear", "conv", "both"])
def test_dora_matches_peft(tmp_path, targets):
    model = lf.tiny()
    x = lf.tiny_input()
    ref, sd = peft_dora(model, targets, seed=len(targets))
    assert {k for k in sd if k.endswith("lora_magnitude_vector")}, "PEFT wrote no magnitudes"
    adapter = load_adapter(lf.write(tmp_path, "dora_peft.safetensors", sd))
    with torch.no_grad():
        base = model(x)
        expected = ref(x)
        bank = SlotBank(model, max_loras=1)
        bank.activate([(adapter, 1.0)])
        got = model(x)
    report = bank.report(adapter)
    assert report.matched == len(targets) and not report.unmatched and not report.leftover
    assert (expected - base).abs().max() > 1e-2  # the adapter has a visible effect
    assert (got - expected).abs().max() <= TOL
