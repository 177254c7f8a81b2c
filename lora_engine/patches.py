"""Per-layer patches: what one adapter file says about one layer.

For a layer with weight W (shape [out, in, *kernel]) and an adapter at strength s,
every patch defines a weight delta ΔW so that the patched layer computes

    f'(x) = f(x) + s · f_ΔW(x)          (f_ΔW: the same op as f, weight ΔW, no bias)

- `LowRank`   ΔW = c · B · A, with A [r, in, *kernel] and B [out, r]. The
              file's alpha/r is computed once, at load, into c; the tensors keep
              their stored dtype and c is applied when B is written to a slot. A LoCon `lora_mid`
              (Tucker core) is folded into A: a 1×1 conv followed by a k×k conv
              is one k×k conv. This is the only kind applied as two small
              matrix products at runtime.
- `LoHa`      ΔW = (W1a·W1b) ⊙ (W2a·W2b) · alpha/r  (Tucker cores optional).
- `LoKr`      ΔW = kron(W1, W2) · alpha/r, W1 and W2 either full or low-rank.
- `FullDiff`  ΔW stored as is.

DoRA (`dora_scale`) follows ComfyUI's semantics so that stacks give the same
image as stock loaders: with W' = W + ΔW, the decomposed weight is
W_d = m ⊙ W' / ‖W'‖ (norm over every axis but the magnitude's), and strength s
moves linearly from W to W_d: ΔW_dora = W_d − W, applied as s · ΔW_dora.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


@dataclass(frozen=True)
class LowRank:
    down: torch.Tensor  # A: [r, in, *kernel]
    up: torch.Tensor  # B: [out, r]
    scale: float  # alpha / r

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def scaled_up(self) -> torch.Tensor:
        return self.up.float() * self.scale

    def delta(self, shape: torch.Size) -> torch.Tensor:
        return (self.scaled_up() @ _flat(self.down.float())).reshape(shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.down, self.up)


def _rebuild(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    if t is None:
        return _flat(a.float()) @ _flat(b.float())
    # Tucker: t [r, r, *k], b [r, in], a [out, r]  ->  [out, in, *k]
    return torch.einsum("ij...,jr,ip->pr...", t.float(), b.float(), a.float())


@dataclass(frozen=True)
class LoHa:
    w1a: torch.Tensor
    w1b: torch.Tensor
    w2a: torch.Tensor
    w2b: torch.Tensor
    t1: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    def delta(self, shape: torch.Size) -> torch.Tensor:
        w = _rebuild(self.w1a, self.w1b, self.t1) * _rebuild(self.w2a, self.w2b, self.t2)
        return (w * self.scale).reshape(shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.w1a, self.w1b, self.w2a, self.w2b, self.t1, self.t2) if t is not None)


@dataclass(frozen=True)
class LoKr:
    w1: torch.Tensor | None
    w1a: torch.Tensor | None
    w1b: torch.Tensor | None
    w2: torch.Tensor | None
    w2a: torch.Tensor | None
    w2b: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    def delta(self, shape: torch.Size) -> torch.Tensor:
        w1 = self.w1.float() if self.w1 is not None else self.w1a.float() @ self.w1b.float()
        if self.w2 is not None:
            w2 = self.w2.float()
        elif self.t2 is not None:
            w2 = torch.einsum("ij...,jr,ip->pr...", self.t2.float(), self.w2b.float(), self.w2a.float())
        else:
            w2 = _flat(self.w2a.float()) @ _flat(self.w2b.float())
            if len(shape) > 2:
                w2 = w2.reshape(w2.shape[0], -1, *shape[2:])
        while w1.dim() < w2.dim():
            w1 = w1.unsqueeze(-1)
        return (torch.kron(w1, w2) * self.scale).reshape(shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        parts = (self.w1, self.w1a, self.w1b, self.w2, self.w2a, self.w2b, self.t2)
        return tuple(t for t in parts if t is not None)


@dataclass(frozen=True)
class FullDiff:
    diff: torch.Tensor

    def delta(self, shape: torch.Size) -> torch.Tensor:
        return self.diff.float().reshape(shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.diff,)


WeightPatch = LowRank | LoHa | LoKr | FullDiff


@dataclass
class LayerPatch:
    """Everything one file holds for one layer key prefix."""

    key: str
    format: str
    weight: WeightPatch | None = None
    bias: torch.Tensor | None = None  # `diff_b`: added to the output as s · Δb
    dora_scale: torch.Tensor | None = None
    source_keys: list[str] = field(default_factory=list)

    @property
    def runtime_low_rank(self) -> bool:
        """True when the patch runs as two small GEMMs; otherwise it takes the dense path."""
        return isinstance(self.weight, LowRank) and self.dora_scale is None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = tuple(t for t in (self.bias, self.dora_scale) if t is not None)
        return (self.weight.tensors() if self.weight is not None else ()) + extra

    def dense_delta(self, shape: torch.Size, base_weight: torch.Tensor | None) -> torch.Tensor | None:
        """ΔW in fp32 for strength 1, or None for a bias-only patch."""
        if self.weight is None:
            return None
        delta = self.weight.delta(shape)
        if self.dora_scale is None:
            return delta
        if base_weight is None:
            raise ValueError("DoRA needs the base weight")
        return dora_delta(base_weight.float(), delta, self.dora_scale.float())


def dora_delta(w: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    merged = w + delta
    if magnitude.shape[0] == merged.shape[0] and magnitude.numel() == merged.shape[0]:
        norm = _flat(merged).norm(dim=1).reshape(merged.shape[0], *[1] * (merged.dim() - 1))
        magnitude = magnitude.reshape(norm.shape)
    else:
        norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
        norm = norm.reshape(1, merged.shape[1], *[1] * (merged.dim() - 2))
        magnitude = magnitude.reshape(norm.shape)
    eps = torch.finfo(torch.float32).eps
    return merged * (magnitude / (norm + eps)) - w
