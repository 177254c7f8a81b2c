"""Full-weight diffs: `.diff` (ΔW stored as is) and `.diff_b` (Δbias); LyCORIS names a norm layer's `.w_norm` and
`.b_norm`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerFit, WeightPatch, absmax, check_numel, f32
from .keys import ParseContext, prefixes
from .layer_patch import LayerPatch, entry

SUFFIXES = ((".diff", ".diff_b"), (".w_norm", ".b_norm"))


@dataclass(frozen=True)
class FullDiff(WeightPatch):
    diff: torch.Tensor

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
        """ΔW into the layer's weight patch, Δb into its bias diff (a layer may have either alone)."""
        found = False
        for weight, bias in SUFFIXES:
            for prefix in prefixes(tensors, weight):
                layer = entry(layers, prefix, "diff", ctx.path)
                layer.weight = cls(tensors.pop(prefix + weight))
                layer.source_keys.append(prefix + weight)
                found = True
            for prefix in prefixes(tensors, bias):
                layer = layers.get(prefix) or layers.setdefault(prefix, LayerPatch(key=prefix, format="diff"))
                layer.bias = tensors.pop(prefix + bias)
                layer.source_keys.append(prefix + bias)
                found = True
        return "diff" if found else None

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        check_numel(self.diff.numel(), layer, path, key)

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        return f32(self.diff, device).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        return absmax(self.diff)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.diff,)
