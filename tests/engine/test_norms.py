"""Full diffs of norm layers (LayerNorm, RMSNorm, GroupNorm): lightx2v distill files carry `.diff` and
`.diff_b` on a DiT's q/k norms and norm3, LyCORIS writes `.w_norm` / `.b_norm`.

The reference is independent of the engine: the same model with w + s·Δw and b + s·Δb written into a
copy of each norm's parameters by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lora_engine import SlotBank, fuse, load_adapter

from .support import lora_files as lf

TOL = 1e-5


class Normed(nn.Module):
    """A conv stem with a GroupNorm, then tokens through LayerNorm, RMSNorm and Linear layers."""

    def __init__(self, ch: int = 8, dim: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(3, ch, 3, padding=1)
        self.group = nn.GroupNorm(4, ch)
        self.proj = nn.Linear(ch, dim)
        self.norm_q = nn.RMSNorm(dim, eps=1e-6)
        self.norm3 = nn.LayerNorm(dim)
        self.plain = nn.LayerNorm(dim, elementwise_affine=False)  # no weight: nothing to adapt
        self.out = nn.Linear(dim, 5)

    def forward(self, x):
        h = self.group(self.conv(x))  # [B, ch, 4, 4]
        t = self.proj(h.flatten(2).transpose(1, 2))  # [B, 16, dim]
        t = t + torch.tanh(self.norm_q(t))
        return self.out(self.plain(self.norm3(t)))


def normed() -> Normed:
    torch.manual_seed(0)
    m = Normed().eval()
    with torch.no_grad():  # parameters away from their defaults, so that a diff is not added to exact 1s
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def norm_tensors(seed: int, weight: str = ".diff", bias: str = ".diff_b") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    return {
        "diffusion_model.group" + weight: r(8), "diffusion_model.group" + bias: r(8),
        "diffusion_model.norm_q" + weight: r(16),
        "diffusion_model.norm3" + weight: r(16), "diffusion_model.norm3" + bias: r(16),
        "diffusion_model.proj.lora_down.weight": r(2, 8), "diffusion_model.proj.lora_up.weight": r(16, 2),
    }


def by_hand(model: Normed, tensors: dict[str, torch.Tensor], s: float, weight=".diff", bias=".diff_b") -> Normed:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name in ("group", "norm_q", "norm3"):
            m = getattr(ref, name)
            m.weight += s * tensors[f"diffusion_model.{name}{weight}"]
            if f"diffusion_model.{name}{bias}" in tensors:
                m.bias += s * tensors[f"diffusion_model.{name}{bias}"]
        up, down = tensors["diffusion_model.proj.lora_up.weight"], tensors["diffusion_model.proj.lora_down.weight"]
        ref.proj.weight += s * up @ down
    return ref


def x_input(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 4, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("names", [(".diff", ".diff_b"), (".w_norm", ".b_norm")], ids=["diff", "lycoris"])
def test_norm_diffs_at_runtime_equal_the_patched_norms(tmp_path, names):
    model, x = normed(), x_input()
    tensors = norm_tensors(0, *names)
    adapter = load_adapter(lf.write(tmp_path, "norms.safetensors", tensors))
    with torch.no_grad():
        base = model(x)
        want = by_hand(model, tensors, -0.7, *names)(x)
        bank = SlotBank(model, max_loras=1)
        report = bank.report(adapter)
        assert report.matched == 4 and not report.unmatched and report.dense == 3, report.line()
        bank.activate([(adapter, -0.7)])
        got = model(x)
    assert (got - want).abs().max() <= TOL
    assert (want - base).abs().max() > 100 * TOL  # the diffs move the output: this test can fail


def test_norm_diffs_per_item_and_stacked(tmp_path):
    model, x = normed(), x_input(3)
    t1, t2 = norm_tensors(1), norm_tensors(2)
    a = load_adapter(lf.write(tmp_path, "a.safetensors", t1), name="a")
    b = load_adapter(lf.write(tmp_path, "b.safetensors", t2), name="b")
    strengths = ([0.0, 0.5, -1.0], [1.0, 0.25, 0.0])
    with torch.no_grad():
        wants = [by_hand(by_hand(model, t1, strengths[0][i]), t2, strengths[1][i])(x[i:i + 1]) for i in range(3)]
        bank = SlotBank(model, max_loras=2)
        bank.activate([(a, strengths[0]), (b, strengths[1])])
        got = model(x)
    for i, want in enumerate(wants):
        assert (got[i:i + 1] - want).abs().max() <= TOL, f"item {i}"


def test_fusing_norm_diffs_equals_runtime(tmp_path):
    model, x = normed(), x_input()
    adapter = load_adapter(lf.write(tmp_path, "norms.safetensors", norm_tensors(3)))
    with torch.no_grad():
        bank = SlotBank(model, max_loras=1)
        bank.activate([(adapter, 0.8)])
        runtime = model(x)
        bank.release()
        fused_model = copy.deepcopy(model)
        result = fuse(fused_model, adapter, 0.8)
        fused = fused_model(x)
    assert result.layers == 4
    assert (fused - runtime).abs().max() <= TOL
    assert not torch.equal(fused_model.norm3.bias, model.norm3.bias)


def test_a_norm_without_weight_is_not_a_target(tmp_path):
    model = normed()
    tensors = {**norm_tensors(4), "diffusion_model.plain.diff": torch.ones(16)}
    adapter = load_adapter(lf.write(tmp_path, "plain.safetensors", tensors))
    report = SlotBank(model, max_loras=1).report(adapter)
    assert report.unmatched == ("diffusion_model.plain",)


def test_a_norm_diff_of_the_wrong_size_names_the_layer(tmp_path):
    from lora_engine import LoRAShapeError

    tensors = {**norm_tensors(5), "diffusion_model.norm3.diff": torch.ones(12)}
    adapter = load_adapter(lf.write(tmp_path, "wrong.safetensors", tensors))
    model = normed()
    with pytest.raises(LoRAShapeError, match="norm3"):
        SlotBank(model, max_loras=1).activate([(adapter, 1.0)])
