"""The weight patch every algorithm implements, the layer it is checked against, and the tensor helpers they share.

For a layer with weight W (shape [out, in, *kernel]) and an adapter at strength s, every patch defines a weight
delta ΔW so that the patched layer computes

    f'(x) = f(x) + s · f_ΔW(x)          (f_ΔW: the same op as f, weight ΔW, no bias)

Each algorithm is one `WeightPatch` subclass in a file of its own (`lowrank`, `loha`, `lokr`, `diff`, `oft`, `boft`,
`glora`), listed once in the registry (`patches.ALGORITHMS`). A subclass carries:
- `parse`: the keys of a file it understands, popped into one patch per layer;
- `check`: its own shape check against the layer it is bound to (`LayerFit`), from shapes alone, before anything is
  materialised (factors of a few KB can describe a product of gigabytes);
- `delta` and `bound`: ΔW in fp32, and a bound on its entries from the factors' maxima;
- its low-rank form, where it has one: `stored_rank` (factors run as stored), or `product_rank` with `factors` and
  `factor_bounds` (factors built from its own), or `half_shapes` and `halves` (a Kronecker product applied as its
  two factors). `plan.ModulePlan` asks these and decides which path a layer takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import LoRAShapeError

REMEDY = "the adapter was trained for another model or model size"


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def f32(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`t` in fp32 on `device` (None: where it is), where a delta is computed."""
    return t.to(device=device, dtype=torch.float32)


def absmax(t: torch.Tensor) -> float:
    """The largest |value| of `t`, read without an |t| copy (fp8, which has no amax on every device, in fp32)."""
    if not t.numel():
        return 0.0
    if t.is_floating_point() and t.element_size() == 1:
        t = t.float()
    return max(abs(float(t.amax())), abs(float(t.amin())))


def finite(t: torch.Tensor) -> bool:
    """Every value of `t` is finite (fp8, which has no isfinite on every device, read in fp32)."""
    return bool(torch.isfinite(t.float() if t.is_floating_point() and t.element_size() == 1 else t).all())


def rebuild(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor | None, device: torch.device | None) -> torch.Tensor:
    """a·b in fp32, or with a Tucker core t [r, r, *k] (b [r, in], a [r, out]) the kernel [out, in, *k]."""
    if t is None:
        return flat(f32(a, device)) @ flat(f32(b, device))
    return torch.einsum("ij...,jr,ip->pr...", f32(t, device), f32(b, device), f32(a, device))


def product_bound(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor | None) -> float:
    """A bound on |entries| of `rebuild(a, b, t)`: the terms each entry sums, times the factors' maxima."""
    terms = flat(a).shape[1] if t is None else t.shape[0] * t.shape[1]
    return terms * absmax(a) * absmax(b) * (1.0 if t is None else absmax(t))


def product_shape(a: torch.Tensor | None, b: torch.Tensor | None, t: torch.Tensor | None) -> tuple[int, ...] | None:
    """The shape of `rebuild(a, b, t)`, or None when the factors do not combine."""
    if a is None or b is None or a.dim() < 1 or b.dim() < 1:
        return None
    if t is None:  # flat(a) @ flat(b)
        if math.prod(a.shape[1:]) != b.shape[0]:
            return None
        return (a.shape[0], math.prod(b.shape[1:]))
    # einsum "ij...,jr,ip->pr...": t [i, j, *k], b [j, r], a [i, p]
    if t.dim() < 2 or a.dim() != 2 or b.dim() != 2 or t.shape[0] != a.shape[0] or t.shape[1] != b.shape[0]:
        return None
    return (a.shape[1], b.shape[1], *t.shape[2:])


def base_of(base: torch.Tensor | None, shape: torch.Size, device: torch.device | None, layout: str) -> torch.Tensor:
    """The base weight in fp32 with `shape`, for a patch whose ΔW reads it."""
    if base is None:
        raise ValueError(f"{layout} needs the base weight")
    return f32(base, device).reshape(shape)


@dataclass(frozen=True)
class LayerFit:
    """The layer a patch is bound to, as its shape check sees it: the layer's name and weight shape, and the output
    rows of it that the patch covers (a fused qkv's slice)."""

    name: str
    weight_shape: torch.Size  # the whole layer's: [out, in/groups, *kernel], or [out] for a norm
    out_slice: tuple[int, int] | None = None

    @property
    def size(self) -> int:
        """The output rows the patch covers."""
        return self.out_slice[1] if self.out_slice else self.weight_shape[0]

    @property
    def inputs(self) -> int:
        """The weight's flattened inputs, in/groups · kernel."""
        return self.weight_shape[1:].numel()

    @property
    def conv(self) -> bool:
        return len(self.weight_shape) > 2

    @property
    def described(self) -> str:
        """The layer as an error names it: its name and weight shape."""
        return f"layer {self.name!r} (weight {tuple(self.weight_shape)!r})"


def check_numel(got: int | None, layer: LayerFit, path: str, key: str) -> None:
    """A product's ΔW of `got` elements (None: its factors do not combine) against the layer's part it patches."""
    if got != layer.size * layer.inputs:
        what = f"patch of {got} elements" if got is not None else "patch whose factors do not combine"
        raise LoRAShapeError(f"{what} does not fit {layer.described}", path=path, key=key, remedy=REMEDY)


class WeightPatch:
    """One algorithm's weight patch for one layer: a frozen dataclass of the file's tensors for that layer (the
    module docstring lists what each subclass carries). `delta(shape, device, base)` and `bound(base_max)` read
    `base` (the layer's weight) and `base_max` (its largest |entry|) only where `reads_weight`."""

    reads_weight: ClassVar[bool] = False  # ΔW is computed from the layer's base weight

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx) -> str | None:
        """Pop the keys of `tensors` this algorithm understands into `layers` (prefix -> `LayerPatch`), reading the
        file's path and metadata from `ctx` (`keys.ParseContext`); the format's name, or None where the file holds
        nothing of it."""
        raise NotImplementedError

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        """Raise `LoRAShapeError` where the patch does not fit `layer`, from shapes alone."""
        raise NotImplementedError

    def reading(self, layer: LayerFit) -> WeightPatch:
        """The patch as it reads for `layer`, where a file's factors fit more than one layout (GLoRA's)."""
        return self

    def narrower_inputs(self, weight_shape: torch.Size) -> int | None:
        """The file's inputs where the patch fits a layer of `weight_shape` but for fewer inputs (a LoRA for the plain
        model on a model with extra input channels), else None."""
        return None

    def widened(self, inputs: int) -> WeightPatch:
        """The patch on `inputs` inputs, its extra ones left unread (zero columns); only where `narrower_inputs`."""
        raise NotImplementedError

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        """ΔW in fp32 with `shape`, computed on `device` (None: where the factors, or `base`, are)."""
        raise NotImplementedError

    def bound(self, base_max: float | None = None) -> float | None:
        """A bound on |ΔW| entries from the factors' maxima; None where none is shown."""
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @property
    def stored_rank(self) -> int | None:
        """The rank of a patch whose factors A and B the slots take as stored (`stored_factors`); else None."""
        return None

    def stored_factors(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(A, B, c) as stored, ΔW = c·B·A, where the slots copy them (c applied as B is written); else None."""
        return None

    @property
    def product_rank(self) -> int | None:
        """The rank of an exact low-rank form built from the factors (`factors`), or None where there is none."""
        return None

    def factors(self, device: torch.device | None = None, base: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in·k], c·B [out, r]) in fp32 with c·B·A = ΔW flattened; only where `product_rank` is not None."""
        raise NotImplementedError

    def factor_bounds(self, base_max: float | None = None) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the factors' maxima (and the base weight's)."""
        raise NotImplementedError

    def half_shapes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The shapes of `halves`, where ΔW is the Kronecker product of two matrices; else None."""
        return None

    def halves(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(c·W1 [a, b], W2 [c, d·k]) in fp32 with ΔW = kron(c·W1, W2); only where `half_shapes` is not None."""
        raise NotImplementedError
