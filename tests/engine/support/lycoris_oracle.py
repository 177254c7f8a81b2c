"""LyCORIS (`lycoris-lora` 4.1.3) as the reference implementation: tiny models, networks, files, references.

A case names LyCORIS's own `create_lycoris` options. The network is built on a copy of a tiny model with every
layer kind diffusion models use, its parameters are filled with seeded random values (LyCORIS starts B, the OFT
blocks and the full diff at zero, which would test nothing), and LyCORIS's `save_weights` writes the file that the
engine then loads. The reference output is LyCORIS's own forward, in its weight-rebuild mode, on that copy.

The reference is the network that wrote the file, not one that LyCORIS's `create_lycoris_from_weights` reads back
from it: that cannot reload a LoKr with a Tucker core (`lokr_t2`). Its `LokrModule.make_module_from_state_dict` takes
the rank from `lokr_w2_a.size(1)` (lycoris/modules/lokr.py:267), which is the output factor in the Tucker layout
([rank, out]), so the module it makes holds a full `lokr_w2` and has no `lokr_w2_a` to copy into (AttributeError at
lokr.py:337).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field

import torch
from lycoris import create_lycoris
from lycoris.logging import logger as lycoris_logger
from lycoris.wrapper import LycorisNetwork
from torch import nn

lycoris_logger.setLevel(logging.WARNING)  # LyCORIS logs every module it makes at INFO

CH = 32  # channels: 32 = 4·8 gives LoKr factors with a low-rank W2 (factorization(32) = (4, 8)) and BOFT stages
TARGETS = ["Linear", "Conv1d", "Conv2d", "Conv3d", "GroupNorm", "LayerNorm"]


class Tiny(nn.Module):
    """One of each layer kind a diffusion model has: Linear with and without bias, Conv1d, Conv2d 3×3 and 1×1, a
    grouped Conv2d, Conv3d, GroupNorm and LayerNorm, each of them on the path to the output."""

    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(8, CH, 3, padding=1)
        self.norm_g = nn.GroupNorm(4, CH)
        self.conv_1x1 = nn.Conv2d(CH, CH, 1)
        self.conv_grouped = nn.Conv2d(CH, CH, 3, padding=1, groups=4)
        self.conv_1d = nn.Conv1d(CH, CH, 3, padding=1)
        self.conv_3d = nn.Conv3d(CH, CH, 3, padding=1)
        self.norm = nn.LayerNorm(CH)
        self.proj = nn.Linear(CH, CH, bias=False)
        self.out = nn.Linear(CH, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_g(self.conv_in(x))  # [B, CH, 4, 4]
        h = h + self.conv_1x1(torch.tanh(h))
        h = h + self.conv_grouped(torch.tanh(h))
        v = self.conv_1d(h.flatten(2))  # [B, CH, 16]
        d = self.conv_3d(torch.stack([h, torch.tanh(h)], dim=2)).mean(2).flatten(2)  # [B, CH, 16]
        t = self.norm((v + d).transpose(1, 2))  # [B, 16 tokens, CH]
        t = t + self.proj(torch.tanh(t))
        return self.out(t)


LAYERS = ("conv_in", "norm_g", "conv_1x1", "conv_grouped", "conv_1d", "conv_3d", "norm", "proj", "out")


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny().eval()
    with torch.no_grad():  # norms away from their (1, 0) initial values, so that a diff of them is not special
        for m in (model.norm_g, model.norm):
            m.weight.add_(torch.randn(m.weight.shape) * 0.2)
            m.bias.add_(torch.randn(m.bias.shape) * 0.2)
    return model


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread, as it was after: the tiny model's ops gain nothing from more, and where other work
    shares the CPU a thread pool's hand-offs make each of them take milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 8, 4, 4, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class Case:
    """One LyCORIS network: `create_lycoris` keyword arguments (`options`), the layers LyCORIS is kept off
    (`exclude`), what its file must hold to show that the option took effect (`holds`: a key's suffix that some key
    ends with, or a whole key and that tensor's shape; `lacks`: suffixes no key ends with), and the strengths at
    which LyCORIS's strength rule is the engine's (`agrees`; None: every strength). At the others, the table of
    docs/lycoris.md, the engine moves each layer linearly from W to LyCORIS's weight at multiplier 1."""

    name: str
    options: dict
    holds: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    lacks: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dim: int = 4
    alpha: float = 2.0
    seed: int = 0
    agrees: tuple[float, ...] | None = None


def _preset(exclude: tuple[str, ...]) -> None:
    """LyCORIS keeps its targets in class attributes; every case sets them all, so that no case sees another's."""
    LycorisNetwork.apply_preset({"enable_conv": True, "target_module": TARGETS, "target_name": [],
                                 "module_algo_map": {}, "name_algo_map": {}, "lora_prefix": "lycoris",
                                 "use_fnmatch": False, "exclude_name": list(exclude)})


def _fill(net: LycorisNetwork, seed: int) -> None:
    """Every parameter of `net` a seeded random value, of a size that makes each layer's ΔW visible next to W."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in net.loras:
            for name, p in lora.named_parameters(recurse=True):
                leaf = name.rsplit(".", 1)[-1]
                noise = torch.randn(p.shape, generator=g)
                if leaf == "dora_scale":  # LyCORIS starts it at ‖W‖; away from it, the magnitude matters
                    p.mul_(0.5 + torch.rand(p.shape, generator=g))
                elif leaf == "rescale":
                    p.copy_(1.0 + 0.3 * noise)
                elif leaf == "oft_blocks":
                    p.copy_(0.15 * noise)
                elif leaf in ("weight", "bias") and type(lora).__name__ == "FullModule":  # the diff itself
                    p.copy_(0.05 * noise)
                elif leaf in ("w_norm", "b_norm"):
                    p.copy_(0.3 * noise)
                else:
                    p.copy_(noise * _factor_std(lora, leaf))


def _factor_std(lora: nn.Module, leaf: str) -> float:
    """A factor's spread: products of more factors get smaller ones, so that ΔW stays of W's order."""
    kind = type(lora).__name__
    if kind == "LohaModule":
        return 0.35
    if kind == "LokrModule":
        return 0.3
    return 0.25


def build(case: Case, model: nn.Module, path: str) -> tuple[nn.Module, LycorisNetwork]:
    """A copy of `model` under a LyCORIS network of `case` (`attach`), and the network."""
    ref = copy.deepcopy(model)
    return ref, attach(case, ref, path)


def attach(case: Case, ref: nn.Module, path: str) -> LycorisNetwork:
    """A LyCORIS network of `case` made by `create_lycoris` on `ref` (networks already on it stay, each adding its
    own ΔW), filled (`_fill`) and applied in LyCORIS's weight-rebuild forward; its file written by LyCORIS's
    `save_weights` to `path`, in fp32."""
    _preset(case.exclude)
    net = create_lycoris(ref, 1.0, linear_dim=case.dim, linear_alpha=case.alpha, conv_dim=case.dim,
                         conv_alpha=case.alpha, warn_on_unmatched=False, **case.options)
    for lora in net.loras:
        lora.bypass_mode = False  # the weight-rebuild forward: ΔW from the factors, as a file defines it
    _fill(net, case.seed)
    net.apply_to()
    net.save_weights(path, torch.float32, None)
    return net


def targets(net: LycorisNetwork, ref: nn.Module) -> dict[str, nn.Module]:
    """The LyCORIS modules of `net`, by the name of the model's layer each wraps."""
    names = {id(m): n for n, m in ref.named_modules()}
    return {names[id(lora.org_module[0])]: lora for lora in net.loras}


def linear_rule(model: nn.Module, ref: nn.Module, net: LycorisNetwork, x: torch.Tensor, strength: float
                ) -> torch.Tensor:
    """The engine's rule where it is not LyCORIS's: each layer's W + s·(W₁ − W), W₁ the layer's weight as
    LyCORIS's own forward rebuilds it at multiplier 1 (read from the weight LyCORIS hands to the layer's op). The
    output of `model` so patched, on `x`."""
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    wrapped = targets(net, ref)
    originals = [(lora, lora.op) for lora in wrapped.values()]
    for name, lora in wrapped.items():
        op = lora.op

        def spy(inp, *args, _name=name, _op=op, **kwargs):
            weight = kwargs.get("weight", args[0] if args else None)
            bias = kwargs.get("bias", args[1] if len(args) > 1 else None)
            deltas[_name] = (weight.detach().clone(), None if bias is None else bias.detach().clone())
            return _op(inp, *args, **kwargs)

        lora.op = spy
    net.set_multiplier(1.0)
    try:
        with torch.no_grad():
            ref(x)
    finally:
        for lora, op in originals:
            lora.op = op
    assert set(deltas) == set(wrapped), f"LyCORIS ran no rebuilt weight for {sorted(set(wrapped) - set(deltas))}"
    patched = copy.deepcopy(model)
    modules = dict(patched.named_modules())
    with torch.no_grad():
        for name, (dw, db) in deltas.items():
            modules[name].weight.add_(dw.reshape(modules[name].weight.shape), alpha=strength)
            if db is not None:
                modules[name].bias.add_(db, alpha=strength)
        return patched(x)


def relative(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """max |got − expected| / max |scale|."""
    return float((got - expected).abs().max()) / float(scale.abs().max())
