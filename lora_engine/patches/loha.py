"""LyCORIS LoHa (`hada_*`): ΔW = (W1a·W1b) ⊙ (W2a·W2b) · alpha/r, Tucker cores (`hada_t1`, `hada_t2`) optional.

Without Tucker cores the product has an exact low-rank form B·A of rank r1·r2 (`factors`), built from its factors:
B[o, (p,q)] = W1a[o,p]·W2a[o,q] and A[(p,q), i] = W1b[p,i]·W2b[q,i] (row-wise and column-wise Kronecker products).
Where that rank is small enough that B and A hold fewer elements than ΔW, the layer runs them as a low-rank adapter
(`plan.ModulePlan`) instead of a dense ΔW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import LayerFit, WeightPatch, absmax, check_numel, f32, flat, product_bound, product_shape, rebuild
from .keys import ParseContext, check_matrices, complete, finite_scale, pop, pop_alpha
from .layer_patch import entry

PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


@dataclass(frozen=True)
class LoHa(WeightPatch):
    w1a: torch.Tensor
    w1b: torch.Tensor
    w2a: torch.Tensor
    w2b: torch.Tensor
    t1: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
        found = False
        for prefix, consumed, (w1a, w1b, w2a, w2b) in complete(tensors, PARTS):
            t1 = pop(tensors, f"{prefix}.hada_t1", consumed)
            t2 = pop(tensors, f"{prefix}.hada_t2", consumed)
            alpha = pop_alpha(tensors, prefix, consumed)
            check_matrices(dict(zip(PARTS, (w1a, w1b, w2a, w2b))), ctx.path, prefix)
            rank = w1b.shape[0]
            scale = finite_scale(alpha / rank if alpha is not None else 1.0, ctx.path, prefix)
            layer = entry(layers, prefix, "loha", ctx.path)
            layer.weight = cls(w1a, w1b, w2a, w2b, t1, t2, scale=scale)
            layer.source_keys.extend(consumed)
            found = True
        return "loha" if found else None

    def dense_numel(self) -> int | None:
        """Elements of the ΔW that `delta` would build, from shapes alone; None when they do not combine."""
        s1, s2 = product_shape(self.w1a, self.w1b, self.t1), product_shape(self.w2a, self.w2b, self.t2)
        return math.prod(s1) if s1 is not None and s1 == s2 else None  # equal shapes: no broadcasting

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        check_numel(self.dense_numel(), layer, path, key)

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        w = rebuild(self.w1a, self.w1b, self.t1, device) * rebuild(self.w2a, self.w2b, self.t2, device)
        return (w * self.scale).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        return abs(self.scale) * product_bound(self.w1a, self.w1b, self.t1) * product_bound(self.w2a, self.w2b,
                                                                                             self.t2)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.w1a, self.w1b, self.w2a, self.w2b, self.t1, self.t2) if t is not None)

    @property
    def product_rank(self) -> int | None:
        """The rank of the exact low-rank form (`factors`), r1·r2; None with Tucker cores."""
        if self.t1 is not None or self.t2 is not None:
            return None
        return self.w1b.shape[0] * self.w2b.shape[0]

    def factors(self, device: torch.device | None = None, base: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r1·r2, in·k], c·B [out, r1·r2]) in fp32, with c·B·A = ΔW (the module docstring)."""
        w1a, w2a = flat(f32(self.w1a, device)), flat(f32(self.w2a, device))
        w1b, w2b = flat(f32(self.w1b, device)), flat(f32(self.w2b, device))
        up = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], -1) * self.scale
        down = (w1b[:, None, :] * w2b[None, :, :]).reshape(-1, w1b.shape[1])
        return down, up

    def factor_bounds(self, base_max: float | None = None) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the stored factors' maxima."""
        return absmax(self.w1b) * absmax(self.w2b), abs(self.scale) * absmax(self.w1a) * absmax(self.w2a)

