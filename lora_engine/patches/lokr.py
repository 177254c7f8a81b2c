"""LyCORIS LoKr (`lokr_*`): ΔW = kron(W1, W2) · alpha/r, W1 and W2 either full or low-rank, W2 with an optional
Tucker core (`lokr_t2`).

Without a Tucker core the product has an exact low-rank form B·A (`factors`): with W1 = U1·V1 and W2 = U2·V2 (a full
factor as I·W or W·I, whichever is narrower), kron(W1, W2) = kron(U1, U2)·kron(V1, V2); a conv's W2 is read as
[out, in·kh·kw], which is how kron lays out ΔW's flattened inputs. Where that rank is small enough that B and A hold
fewer elements than ΔW, the layer runs them as a low-rank adapter (`plan.ModulePlan`).

A LoKr on a Linear whose product has no such small form is applied as it is stored (`halves`):
kron(W1, W2)·x = vec(W1 · X · W2ᵀ), X the input read as [b, d], two small products of b·d·c + a·b·c multiply-adds
per token against a·b·c·d for ΔW (`runtime.Kron`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LoRAShapeError
from .base import (LayerFit, WeightPatch, absmax, check_numel, f32, flat, product_bound, product_shape,
                   rebuild)
from .keys import ParseContext, check_matrices, finite_scale, pop, pop_alpha, prefixes
from .layer_patch import entry

PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


@dataclass(frozen=True)
class LoKr(WeightPatch):
    w1: torch.Tensor | None
    w1a: torch.Tensor | None
    w1b: torch.Tensor | None
    w2: torch.Tensor | None
    w2a: torch.Tensor | None
    w2b: torch.Tensor | None
    t2: torch.Tensor | None
    scale: float

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
        heads = set(prefixes(tensors, ".lokr_w1")) | set(prefixes(tensors, ".lokr_w1_a"))
        found = False
        for prefix in sorted(heads):
            has_w1 = f"{prefix}.lokr_w1" in tensors or f"{prefix}.lokr_w1_b" in tensors
            has_w2 = f"{prefix}.lokr_w2" in tensors or (f"{prefix}.lokr_w2_a" in tensors
                                                         and f"{prefix}.lokr_w2_b" in tensors)
            if not (has_w1 and has_w2):
                continue
            consumed: list[str] = []
            parts = {p: pop(tensors, f"{prefix}.{p}", consumed) for p in PARTS}
            alpha = pop_alpha(tensors, prefix, consumed)
            check_matrices({p: parts[p] for p in PARTS if p != "lokr_t2"}, ctx.path, prefix)
            # As in LyCORIS: alpha/rank applies only when a factor is itself low-rank. LyCORIS gives both factors one
            # rank; where a file's differ, w2's counts, as in ComfyUI's LoraLoader.
            rank = None
            if parts["lokr_w2_b"] is not None:
                rank = parts["lokr_w2_b"].shape[0]
            elif parts["lokr_w1_b"] is not None:
                rank = parts["lokr_w1_b"].shape[0]
            scale = finite_scale(alpha / rank if alpha is not None and rank else 1.0, ctx.path, prefix)
            layer = entry(layers, prefix, "lokr", ctx.path)
            layer.weight = cls(*(parts[p] for p in PARTS), scale=scale)
            layer.source_keys.extend(consumed)
            found = True
        return "lokr" if found else None

    def dense_numel(self) -> int | None:
        """Elements of the ΔW that `delta` would build, from shapes alone; None when they do not combine."""
        w1_2d = self.w1a is not None and self.w1b is not None and self.w1a.dim() == 2 and self.w1b.dim() == 2
        n1 = self.w1.numel() if self.w1 is not None else _numel(product_shape(self.w1a, self.w1b, None)) if w1_2d \
            else None  # W1 = w1a @ w1b: a plain matrix product
        n2 = self.w2.numel() if self.w2 is not None else _numel(product_shape(self.w2a, self.w2b, self.t2))
        return n1 * n2 if n1 is not None and n2 is not None else None  # kron: the product of both sizes

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        check_numel(self.dense_numel(), layer, path, key)
        # A conv's low-rank W2 without a Tucker core, W2a·W2b [c, n], holds the kernel as LyCORIS writes it: n = d·k,
        # d of the layer's input channels and k its kernel positions (`delta` reads it so).
        kernel = math.prod(layer.weight_shape[2:])
        width = self.w2b[0].numel() if layer.conv and self.w2 is None and self.t2 is None else 0
        if width % kernel:
            raise LoRAShapeError(f"LoKr W2 = lokr_w2_a·lokr_w2_b has {width} columns, not a whole number of "
                                 f"kernels of {kernel} positions of {layer.described}", path=path, key=key,
                                 remedy="the file is not a LoKr layout this layer can take (LyCORIS writes W2's "
                                 "columns as input channels × kernel); re-export it for this model")

    def _w1(self, device: torch.device | None) -> torch.Tensor:
        return f32(self.w1, device) if self.w1 is not None else f32(self.w1a, device) @ f32(self.w1b, device)

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        w1 = self._w1(device)
        if self.w2 is not None:
            w2 = f32(self.w2, device)
        elif self.t2 is not None:
            # The Tucker rebuild is a permuted einsum result, which kron cannot view: both factors made contiguous.
            w1, w2 = w1.contiguous(), rebuild(self.w2a, self.w2b, self.t2, device).contiguous()
        else:
            w2 = rebuild(self.w2a, self.w2b, None, device)
            if len(shape) > 2:
                w2 = w2.reshape(w2.shape[0], -1, *shape[2:])
        while w1.dim() < w2.dim():
            w1 = w1.unsqueeze(-1)
        return (torch.kron(w1, w2) * self.scale).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        w1 = absmax(self.w1) if self.w1 is not None else product_bound(self.w1a, self.w1b, None)
        w2 = absmax(self.w2) if self.w2 is not None else product_bound(self.w2a, self.w2b, self.t2)
        return abs(self.scale) * w1 * w2

    def tensors(self) -> tuple[torch.Tensor, ...]:
        parts = (self.w1, self.w1a, self.w1b, self.w2, self.w2a, self.w2b, self.t2)
        return tuple(t for t in parts if t is not None)

    def half_shapes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The shapes of `halves`, from the stored shapes; None with a Tucker core."""
        if self.t2 is not None:
            return None
        w1 = flat(self.w1).shape if self.w1 is not None else (self.w1a.shape[0], flat(self.w1b).shape[1])
        w2 = flat(self.w2).shape if self.w2 is not None else (self.w2a.shape[0], flat(self.w2b).shape[1])
        return (w1[0], w1[1]), (w2[0], w2[1])

    def halves(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(c·W1 [a, b], W2 [c, d·k]) in fp32, each factor whole, with ΔW = kron(c·W1, W2) (no Tucker core)."""
        w2 = flat(f32(self.w2, device)) if self.w2 is not None else rebuild(self.w2a, self.w2b, None, device)
        return flat(self._w1(device)) * self.scale, w2

    @property
    def product_rank(self) -> int | None:
        """The rank of the exact low-rank form (`factors`); None with a Tucker core."""
        if self.t2 is not None:
            return None
        r1 = min(flat(self.w1).shape) if self.w1 is not None else flat(self.w1b).shape[0]
        r2 = min(flat(self.w2).shape) if self.w2 is not None else flat(self.w2b).shape[0]
        return r1 * r2

    def factors(self, device: torch.device | None = None, base: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in·k], c·B [out, r]) in fp32, with c·B·A = ΔW flattened (the module docstring)."""
        u1, v1 = _split(self.w1, self.w1a, self.w1b, device)
        u2, v2 = _split(self.w2, self.w2a, self.w2b, device)
        return torch.kron(v1, v2), torch.kron(u1, u2) * self.scale

    def factor_bounds(self, base_max: float | None = None) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the stored factors' maxima."""
        v1, u1 = _maxima(self.w1, self.w1a, self.w1b)
        v2, u2 = _maxima(self.w2, self.w2a, self.w2b)
        return v1 * v2, abs(self.scale) * u1 * u2


def _numel(shape: tuple[int, ...] | None) -> int | None:
    return math.prod(shape) if shape is not None else None


def _wide(full: torch.Tensor) -> bool:
    """A full factor [m, n] with m ≤ n is split as I·W (its rank m), else as W·I."""
    f = flat(full)
    return f.shape[0] <= f.shape[1]


def _maxima(full: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    """(max |V|, max |U|) of `_split`'s halves: an identity's is 1."""
    if full is None:
        return absmax(b), absmax(a)
    return (absmax(full), 1.0) if _wide(full) else (1.0, absmax(full))


def _split(full: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor | None,
           device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) in fp32 with U·V the factor: a low-rank one's own (a, b), a full one's with an identity."""
    if full is None:
        return flat(f32(a, device)), flat(f32(b, device))
    w = flat(f32(full, device))
    if _wide(full):
        return torch.eye(w.shape[0], dtype=torch.float32, device=w.device), w
    return w, torch.eye(w.shape[1], dtype=torch.float32, device=w.device)
