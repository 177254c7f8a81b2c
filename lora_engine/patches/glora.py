"""LyCORIS GLoRA (`a1`, `a2`, `b1`, `b2`, optional Tucker core `bm`): ΔW = c · (W·A1·A2 + B1·B2), with A1 [n, ra],
A2 [ra, n], B1 [out, rb], B2 [rb, in, *kernel] and c = alpha / ra.

W·A1·A2 mixes the weight's inputs: n is the flattened inputs (in·k) where A1 has that many rows, else (a conv,
LyCORIS's current layout) the input channels, per kernel position. It reads the base weight, and is linear in s.

A GLoRA that mixes the flattened inputs (every Linear's, and a conv's in the older layout) is itself of rank ra + rb:
ΔW = c·[W·A1 | B1] · [A2 ; B2], with W·A1 [out, ra] computed from the base weight when the slot is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..errors import LoRAShapeError
from .base import REMEDY, LayerFit, WeightPatch, absmax, base_of, f32, flat, product_bound
from .keys import ParseContext, check_matrices, complete, finite_scale, pop, pop_alpha
from .layer_patch import entry

PARTS = ("a1.weight", "a2.weight", "b1.weight", "b2.weight")


@dataclass(frozen=True)
class Glora(WeightPatch):
    a1: torch.Tensor  # [n, ra]: n the weight's flattened inputs, or a conv's input channels
    a2: torch.Tensor  # [ra, n]
    b1: torch.Tensor  # [out, rb]
    b2: torch.Tensor  # [rb, in, *kernel], or [rb, in·k]
    scale: float  # alpha / ra
    # The file's other reading of the same factors, where both of LyCORIS's layouts fit their shapes (a square
    # layer); binding takes it where this one does not fit the layer (`parse`, `reading`).
    alternate: Glora | None = field(default=None, repr=False, compare=False)
    reads_weight = True

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
        """`{prefix}.a1.weight`, `.a2.weight`, `.b1.weight`, `.b2.weight`, an optional Tucker core `.bm.weight` and
        `.alpha`, in either of LyCORIS's layouts, told apart by their shapes as ComfyUI's LoraLoader does:
        - current: ΔW = W·a1·a2 + b1·b2, a1 [n, r], a2 [r, n], b1 [out, r], b2 [r, in, *k]; a conv's a1 and a2 are
          1×1 convs over its channels, and with a Tucker core b2 is a 1×1 conv and bm [r, r, *k] the kernel;
        - older: ΔW = b2·b1 + W·a2·a1 with the roles of 1 and 2 swapped, over the flattened inputs.
        Where both readings fit the shapes, a1 and b1 are [x, y] and a2 and b2 [y, x]: the older reading is of rank
        x on a square layer of y, the current one of rank y on a square layer of x. The one of the smaller rank
        comes first (the older one where x = y), the other is kept as its `alternate`, and binding takes the one
        that fits the layer, as ComfyUI's LoraLoader decides by the layer's size. The scale is alpha / r (1 without
        alpha)."""
        found = False
        for prefix, consumed, (a1, a2, b1, b2) in complete(tensors, PARTS):
            mid = pop(tensors, f"{prefix}.bm.weight", consumed)
            alpha = pop_alpha(tensors, prefix, consumed)
            check_matrices(dict(zip(PARTS, (a1, a2, b1, b2))), ctx.path, prefix)
            (a1o, a1i), (a2o, a2i), (b1o, b1i), (b2o, b2i) = (_flat_shape(t) for t in (a1, a2, b1, b2))
            older = b2i == b1o == a1o == a2i and mid is None
            current = b2o == b1i == a1i == a2o
            readings = []
            if older:
                readings.append((a2.reshape(a2o, a2i), a1.reshape(a1o, a1i), b2.reshape(b2o, b2i), b1))
            if current:
                b2 = _tucker(mid, b2, ctx.path, prefix) if mid is not None else b2
                readings.append((a1.reshape(a1o, a1i), a2.reshape(a2o, a2i), b1.reshape(b1o, b1i), b2))
            if len(readings) == 2 and a1o > a1i:  # a1, b1 [x, y] and a2, b2 [y, x]: the smaller rank first
                readings.reverse()
            if not readings:
                shapes = ", ".join(f"{p.split('.')[0]} {tuple(t.shape)!r}" for p, t in zip(PARTS, (a1, a2, b1, b2)))
                raise LoRAShapeError(f"GLoRA factors {shapes} share no rank in either GLoRA layout", path=ctx.path,
                                     key=prefix, remedy="the file is corrupt; re-export it")
            patches = [cls(*f, scale=finite_scale(alpha / f[1].shape[0] if alpha is not None else 1.0, ctx.path,
                                                  prefix)) for f in readings]
            layer = entry(layers, prefix, "glora", ctx.path)
            layer.weight = patches[0] if len(patches) == 1 else replace(patches[0], alternate=patches[1])
            layer.source_keys.extend(consumed)
            found = True
        return "glora" if found else None

    def fits(self, layer: LayerFit) -> bool:
        """B1 [size, rb] and B2 [rb, in·k] make the layer's ΔW, and A1 [n, ra], A2 [ra, n] mix its flattened inputs
        or, on a conv, its input channels."""
        inputs = layer.inputs
        mixes = (inputs, layer.weight_shape[1]) if layer.conv else (inputs,)
        n = self.a1.shape[0]
        return (self.b1.shape[0] == layer.size and self.b1.shape[1] == self.b2.shape[0]
                and self.b2[0].numel() == inputs and n in mixes and tuple(self.a2.shape) == (self.a1.shape[1], n))

    def reading(self, layer: LayerFit) -> Glora:
        """This reading, unless only its alternate fits `layer`."""
        if self.alternate is None or self.fits(layer) or not self.alternate.fits(layer):
            return self
        return self.alternate

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        if not self.fits(layer):
            shapes = ", ".join(f"{k} {tuple(getattr(self, k).shape)!r}" for k in ("a1", "a2", "b1", "b2"))
            raise LoRAShapeError(f"GLoRA factors ({shapes}, as the current layout names them) do not fit "
                                 f"{layer.described}", path=path, key=key, remedy=REMEDY)

    def _mixed(self, base: torch.Tensor | None, shape: torch.Size, device: torch.device | None) -> torch.Tensor:
        """W·A1·A2 [*shape] in fp32: over the flattened inputs, or a conv's channels at each kernel position."""
        w = base_of(base, shape, device, "GLoRA")
        a1, a2 = f32(self.a1, w.device), f32(self.a2, w.device)
        if self.flat:
            return ((flat(w) @ a1) @ a2).reshape(shape)
        return torch.einsum("oi...,ij,jn->on...", w, a1, a2)

    @property
    def flat(self) -> bool:
        """A1 mixes the flattened inputs, which B2's flattened width gives."""
        return self.a1.shape[0] == flat(self.b2).shape[1]

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        mixed = self._mixed(base, shape, device)
        return (mixed + (f32(self.b1, mixed.device) @ flat(f32(self.b2, mixed.device))).reshape(shape)) * self.scale

    def bound(self, base_max: float | None = None) -> float | None:
        """Each entry of W·A1·A2 sums ra·n terms |W|·|A1|·|A2| (n: A2's width); None without `base_max`."""
        if base_max is None:
            return None
        ra, n = self.a2.shape
        mixed = ra * n * base_max * absmax(self.a1) * absmax(self.a2)
        return abs(self.scale) * (mixed + product_bound(self.b1, self.b2, None))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.a1, self.a2, self.b1, self.b2)

    @property
    def product_rank(self) -> int | None:
        """ra + rb where A1 mixes the flattened inputs (the low-rank form of the module docstring), else None."""
        return self.a2.shape[0] + self.b2.shape[0] if self.flat else None

    def factors(self, device: torch.device | None = None, base: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [ra + rb, n], c·B [out, ra + rb]) in fp32 with c·B·A = ΔW flattened, for the base weight `base`."""
        if base is None:
            raise ValueError("GLoRA needs the base weight")
        w = flat(f32(base, device))
        up = torch.cat([w @ f32(self.a1, w.device), flat(f32(self.b1, w.device))], dim=1) * self.scale
        return torch.cat([f32(self.a2, w.device), flat(f32(self.b2, w.device))]), up

    def factor_bounds(self, base_max: float | None = None) -> tuple[float, float]:
        """Bounds on |A| and |c·B| entries of `factors`, from the factors' maxima and the base weight's."""
        n = self.a1.shape[0]
        return (max(absmax(self.a2), absmax(self.b2)),
                abs(self.scale) * max(n * base_max * absmax(self.a1), absmax(self.b1)))


def _flat_shape(t: torch.Tensor) -> tuple[int, int]:
    return t.shape[0], t[0].numel()


def _tucker(mid: torch.Tensor, b2: torch.Tensor, path: str, prefix: str) -> torch.Tensor:
    """b2 [r, in, 1, ...] after the core bm [r, r, *k], as one kernel [r, in, *k]: a 1×1 conv then a k×k conv."""
    r = b2.shape[0]
    if mid.dim() < 3 or tuple(mid.shape[:2]) != (r, r):
        raise LoRAShapeError(f"GLoRA Tucker core bm {tuple(mid.shape)!r} does not fit b2 {tuple(b2.shape)!r}",
                             path=path, key=f"{prefix}.bm.weight", remedy="the file is corrupt; re-export it")
    return torch.einsum("ij...,jn->in...", mid.float(), b2.reshape(r, -1).float()).to(b2.dtype)
