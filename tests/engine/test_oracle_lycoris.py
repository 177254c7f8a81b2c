"""Oracle test: a LoKr with a Tucker core (`lokr_t2`) on a conv layer against LyCORIS's own `LokrModule`.

LyCORIS writes a conv LoKr with `use_tucker` as a full w1, a low-rank w2 (`lokr_w2_a`, `lokr_w2_b`) and the core
`lokr_t2` [r, r, kh, kw]. The adapter is the module's own state dict with random factors, written as a file and
applied at two strengths; LyCORIS's forward at the same multiplier is the expected output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lora_engine import SlotBank, load_adapter

from .support import lora_files as lf

lokr = pytest.importorskip("lycoris.modules.lokr")


class ConvModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def lycoris_lokr(conv: nn.Conv2d, dtype: torch.dtype) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """LyCORIS's LoKr on `conv` (in `dtype`) with a Tucker core, random factors, and its state dict as a file's."""
    module = lokr.LokrModule("lora_unet_conv", conv, multiplier=1.0, lora_dim=2, alpha=1.5, use_tucker=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    module = module.to(dtype).eval()
    sd = {f"lora_unet_conv.{k}": v.detach().float().contiguous() for k, v in module.custom_state_dict().items()}
    return module, sd


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_conv_lokr_with_a_tucker_core_matches_lycoris(tmp_path, strength):
    torch.manual_seed(0)
    model = ConvModel().eval()
    x = torch.randn(2, 32, 6, 6)
    ref, sd = lycoris_lokr(model.conv, torch.float32)
    assert ref.tucker and "lora_unet_conv.lokr_t2" in sd, "LyCORIS wrote no Tucker core"
    ref64, _ = lycoris_lokr(copy.deepcopy(model.conv).double(), torch.float64)
    adapter = load_adapter(lf.write(tmp_path, "lokr_tucker.safetensors", sd))
    with torch.no_grad():
        base = model(x)
        ref.multiplier = ref64.multiplier = strength
        expected = ref(x)
        # The floor: LyCORIS's own fp32 output against its fp64 one, for the same factors.
        floor = (expected.double() - ref64(x.double())).abs().max().item()
        bank = SlotBank(model, max_loras=1)
        bank.activate([(adapter, strength)])
        got = model(x)
    report = bank.report(adapter)
    assert report.matched == 1 and report.formats == ("lokr",) and not report.leftover
    assert (expected - base).abs().max() > 1e-2  # the adapter has a visible effect
    tol = 4 * max(floor, torch.finfo(torch.float32).eps * expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tol
