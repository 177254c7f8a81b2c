"""`LayerPatch`: everything one file holds for one layer key prefix, its weight patch, bias diff and DoRA
magnitude."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import LoRAFormatError
from .base import WeightPatch, absmax, f32
from .dora import dora_delta


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
    def reads_weight(self) -> bool:
        """ΔW is computed from the layer's base weight (DoRA, OFT, BOFT, GLoRA)."""
        return self.dora_scale is not None or (self.weight is not None and self.weight.reads_weight)

    @property
    def runtime_low_rank(self) -> bool:
        """True when the patch is a low-rank one, run as two small GEMMs as stored."""
        return self.weight is not None and self.weight.stored_rank is not None and self.dora_scale is None

    @property
    def product_rank(self) -> int | None:
        """The rank of the exact low-rank form of the weight patch's product (a LoHa or LoKr without Tucker cores, or a
        GLoRA), without DoRA; else None. `plan.ModulePlan` decides whether the layer runs it."""
        if self.dora_scale is not None or self.weight is None:
            return None
        return self.weight.product_rank

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = tuple(t for t in (self.bias, self.dora_scale) if t is not None)
        return (self.weight.tensors() if self.weight is not None else ()) + extra

    def dense_delta(self, shape: torch.Size, base_weight: torch.Tensor | None,
                    device: torch.device | None = None) -> torch.Tensor | None:
        """ΔW in fp32 for strength 1, computed on `device` (None: the factors' own), or None for a bias-only
        patch."""
        if self.weight is None:
            return None
        delta = self.weight.delta(shape, device, base_weight)
        if self.dora_scale is None:
            return delta
        if base_weight is None:
            raise ValueError("DoRA needs the base weight")
        return dora_delta(f32(base_weight, delta.device), delta, f32(self.dora_scale, delta.device))

    def bound(self, base_max: float | None = None) -> float | None:
        """A bound on |ΔW| entries from the factors' maxima. DoRA's, OFT's, BOFT's and GLoRA's also need
        `base_max`, the largest |entry| of the base weight (the patch's own `bound`). DoRA's: each entry of
        m ⊙ W'/‖W'‖ is at most |m|, so |ΔW_dora| ≤ max|m| + max|W| wherever W' is finite in fp32. None where no
        bound is shown."""
        if self.weight is None:
            return 0.0
        bound = self.weight.bound(base_max)
        if bound is None:
            return None
        if self.dora_scale is None:
            return bound
        if base_max is None or bound + base_max > 0.5 * torch.finfo(torch.float32).max:
            return None
        return absmax(self.dora_scale) + base_max


def entry(layers: dict[str, LayerPatch], prefix: str, fmt: str, path: str) -> LayerPatch:
    """The layer entry for `prefix`, made where there is none; a second weight patch for one prefix is an error."""
    found = layers.get(prefix)
    if found is None:
        found = layers[prefix] = LayerPatch(key=prefix, format=fmt)
    elif found.weight is not None:
        raise LoRAFormatError(f"two weight patches ({found.format} and {fmt}) target one layer", path=path,
                              key=prefix, remedy="the file mixes formats for one layer; re-export it")
    return found
