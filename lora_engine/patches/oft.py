"""LyCORIS diag-OFT and kohya's OFT (`oft_blocks` [k, b, b], `alpha`, optional `rescale`).

W' = m ⊙ Rᵀ·W per block of output rows, R = (I + Q)(I − Q)⁻¹ orthogonal (Cayley), Q = P − Pᵀ from the stored blocks
P [k, b, b], m the optional `rescale` per output row; ΔW = W' − W reads the base weight, as DoRA's does, and strength
s moves linearly from W to W', as in kohya's OFT and in LyCORIS without `rescale`. (LyCORIS computes m ⊙ (s·Rᵀ +
(1 − s)·I)·W, so with a `rescale` the two agree at s = 1 only, and LyCORIS's s = 0 is m ⊙ W, not the base weight;
docs/lycoris.md.) Where the file's alpha > 0 it is the constraint: Q is scaled down to Frobenius norm alpha·n
(n = k·b, the layer's outputs; over all of its blocks) where ‖Q‖ exceeds that, as both trainers bound it. (ComfyUI
0.28's LoraLoader bounds ‖Q‖ by alpha itself, adds s²·(Rᵀ − I)·W and drops `rescale`; at s = 1, without `rescale`
and with ‖Q‖ ≤ alpha, the two agree.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import LoRAShapeError
from .base import REMEDY, LayerFit, WeightPatch, absmax, base_of, f32
from .keys import ParseContext, finite_scale, pop, pop_alpha, prefixes
from .layer_patch import entry


class Rotation(WeightPatch):
    """What OFT and BOFT share: blocks P of one file key, `oft_blocks`, told apart by their number of dimensions, the
    constraint and the rescale; both read the base weight and rotate every output row of the layer."""

    dims: ClassVar[int]  # of `oft_blocks`
    name: ClassVar[str]
    reads_weight = True

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
        found = False
        for prefix in prefixes(tensors, ".oft_blocks"):
            key = f"{prefix}.oft_blocks"
            blocks = tensors[key]
            if blocks.dim() not in (3, 4):
                raise LoRAShapeError(f"oft_blocks {tuple(blocks.shape)!r} is neither a stack of square blocks "
                                     "[k, b, b] nor BOFT's stages of them [M, k, b, b]", path=ctx.path, key=key,
                                     remedy="the file is corrupt; re-export it")
            if blocks.dim() != cls.dims:
                continue
            _check_blocks(blocks, ctx.path, key)
            consumed: list[str] = []
            pop(tensors, key, consumed)
            rescale = pop(tensors, f"{prefix}.rescale", consumed)
            outputs = blocks.shape[-3] * blocks.shape[-1]
            if rescale is not None and rescale.numel() != outputs:
                raise LoRAShapeError(f"rescale {tuple(rescale.shape)!r} does not hold one factor for each of the "
                                     f"{outputs} outputs of oft_blocks {tuple(blocks.shape)!r}", path=ctx.path,
                                     key=f"{prefix}.rescale", remedy="the file is corrupt; re-export it")
            alpha = pop_alpha(tensors, prefix, consumed)
            layer = entry(layers, prefix, cls.name, ctx.path)
            layer.weight = cls(blocks, constraint=finite_scale(alpha or 0.0, ctx.path, prefix), rescale=rescale)
            layer.source_keys.extend(consumed)
            found = True
        return cls.name if found else None

    @property
    def outputs(self) -> int:
        return self.blocks.shape[-3] * self.blocks.shape[-1]

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        rows, size = self.outputs, layer.size
        if rows != size:
            where = f" in its output slice {layer.out_slice!r}" if layer.out_slice else ""
            raise LoRAShapeError(f"OFT blocks {tuple(self.blocks.shape)!r} rotate {rows} output rows, but layer "
                                 f"{layer.name!r} has {size}{where}", path=path, key=key, remedy=REMEDY)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,) if self.rescale is None else (self.blocks, self.rescale)


@dataclass(frozen=True)
class Oft(Rotation):
    blocks: torch.Tensor  # P: [k, b, b], k·b the layer's outputs
    constraint: float  # the file's alpha: ‖Q‖ ≤ alpha · outputs; 0: none
    rescale: torch.Tensor | None  # m: one factor per output row, or None
    dims: ClassVar[int] = 3
    name: ClassVar[str] = "oft"

    def rotation(self, device: torch.device | None = None) -> torch.Tensor:
        """R [k, b, b] in fp32, each block orthogonal."""
        return cayley(self.blocks, self.constraint * self.outputs, device)

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        """ΔW = m ⊙ Rᵀ·W − W in fp32 for the base weight `base` (of `shape`), computed on `device` (None: where
        `base` is)."""
        base = base_of(base, shape, device, "OFT")
        r = self.rotation(base.device)
        k, b, _ = r.shape
        rotated = torch.einsum("knm,kn...->km...", r, base.reshape(k, b, *base.shape[1:])).reshape(base.shape)
        return rescaled(rotated, self.rescale) - base

    def bound(self, base_max: float | None = None) -> float | None:
        """|m ⊙ Rᵀ·W| ≤ max|m| · √b · max|W| entrywise (R's columns are unit vectors), plus |W|; None without
        `base_max`."""
        if base_max is None:
            return None
        m = 1.0 if self.rescale is None else absmax(self.rescale)
        return (m * self.blocks.shape[1] ** 0.5 + 1.0) * base_max


def cayley(blocks: torch.Tensor, constraint: float, device: torch.device | None) -> torch.Tensor:
    """R = (I + Q)(I − Q)⁻¹ in fp32 for each block P [..., b, b], Q = P − Pᵀ scaled down to Frobenius norm
    `constraint` (over all blocks) where that is > 0 and ‖Q‖ exceeds it: each R is orthogonal."""
    p = f32(blocks, device)
    q = p - p.transpose(-1, -2)
    if constraint > 0:
        norm = float(torch.linalg.norm(q)) + 1e-8
        if norm > constraint:
            q = q * (constraint / norm)
    eye = torch.eye(q.shape[-1], dtype=torch.float32, device=q.device)
    return (eye + q) @ torch.linalg.inv(eye - q)


def rescaled(rotated: torch.Tensor, rescale: torch.Tensor | None) -> torch.Tensor:
    if rescale is None:
        return rotated
    return rotated * f32(rescale, rotated.device).reshape(rotated.shape[0], *[1] * (rotated.dim() - 1))


def _check_blocks(blocks: torch.Tensor, path: str, key: str) -> None:
    shape = tuple(blocks.shape)
    problem = None
    if blocks.shape[-1] != blocks.shape[-2] or blocks.numel() == 0:
        problem = "is not a stack of square blocks [k, b, b]" if blocks.dim() == 3 else \
            "is not a stack of BOFT stages of square blocks [M, k, b, b]"
    elif blocks.dim() == 4 and blocks.shape[-1] % 2:
        problem = "has BOFT blocks of an odd size: a butterfly stage rotates pairs of halves of a block"
    elif blocks.dim() == 4 and blocks.shape[1] % (1 << (blocks.shape[0] - 1)):
        problem = (f"has {blocks.shape[0]} BOFT stages, which need a multiple of 2^{blocks.shape[0] - 1} blocks "
                   f"per stage, not {blocks.shape[1]}")
    if problem:
        raise LoRAShapeError(f"oft_blocks {shape!r} {problem}", path=path, key=key,
                             remedy="the file is corrupt; re-export it")
