"""LyCORIS BOFT (butterfly OFT): `oft_blocks` [M, k, b, b], M butterfly stages of k blocks, with `alpha` and
`rescale` as diag-OFT's (`oft`). Stage i pairs rows 2^i · b/2 apart within groups of 2^i · b rows, so b is even and
k a multiple of 2^(M−1).

W' = m ⊙ D·W with D = D_{M−1} ⋯ D_0, one stage per block of the stored P: D_i = Π_iᵀ · blockdiag(R_i) · Π_i, R_i
the Cayley rotations of stage i (the constraint bounds ‖Q‖ over all stages, as for OFT), and Π_i the butterfly
permutation of the output rows, which reads them in groups of 2·h (h = 2^i · b/2) as h pairs of rows h apart.
ΔW = W' − W; s moves linearly from W to W'. (LyCORIS and ComfyUI 0.28 move each stage's R_i linearly from I
instead, so W' is a polynomial of degree M in s there, and ComfyUI also multiplies the delta by s. All three agree
at s = 1; at s = 0 ComfyUI's and this are W, and so is LyCORIS's without `rescale`, but with one LyCORIS applies m
at every strength: m ⊙ W; docs/lycoris.md.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import absmax, base_of, flat
from .oft import Rotation, cayley, rescaled


@dataclass(frozen=True)
class Boft(Rotation):
    blocks: torch.Tensor  # P: [M, k, b, b], one stage of k blocks each, k·b the layer's outputs; b even
    constraint: float  # the file's alpha, as `Oft`'s
    rescale: torch.Tensor | None
    dims: ClassVar[int] = 4
    name: ClassVar[str] = "boft"

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        """ΔW = m ⊙ D·W − W in fp32 for the base weight `base` (of `shape`), computed on `device` (None: where
        `base` is)."""
        base = base_of(base, shape, device, "BOFT")
        r = cayley(self.blocks, self.constraint * self.outputs, base.device)
        b = r.shape[-1]
        w = flat(base)
        cols = w.shape[1]
        for i, stage in enumerate(r):
            half = (b // 2) << i
            paired = w.reshape(-1, 2, half, cols).transpose(1, 2).reshape(-1, b, cols)  # Π_i·W, in blocks of b
            rotated = torch.bmm(stage, paired)
            w = rotated.reshape(-1, half, 2, cols).transpose(1, 2).reshape(-1, cols)  # Π_iᵀ
        return rescaled(w.reshape(shape), self.rescale) - base

    def bound(self, base_max: float | None = None) -> float | None:
        """D is orthogonal and each of its rows has at most min(n, b^M) nonzero entries (each stage mixes b rows),
        so |m ⊙ D·W| ≤ max|m| · √min(n, b^M) · max|W|, plus |W|; None without `base_max`."""
        if base_max is None:
            return None
        stages, _, b, _ = self.blocks.shape
        m = 1.0 if self.rescale is None else absmax(self.rescale)
        return (m * min(self.outputs, b ** stages) ** 0.5 + 1.0) * base_max
