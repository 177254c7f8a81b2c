"""Full-weight diffs: `.diff` (ΔW) and `.diff_b` (Δbias)."""

from __future__ import annotations

import torch

from ..patches import FullDiff, LayerPatch
from ._util import ParseContext, layer, prefixes


def parse(tensors: dict[str, torch.Tensor], layers: dict[str, LayerPatch], ctx: ParseContext) -> str | None:
    found = False
    for prefix in prefixes(tensors, ".diff"):
        entry = layer(layers, prefix, "diff", ctx.path)
        entry.weight = FullDiff(tensors.pop(prefix + ".diff"))
        entry.source_keys.append(prefix + ".diff")
        found = True
    for prefix in prefixes(tensors, ".diff_b"):
        entry = layers.get(prefix) or layers.setdefault(prefix, LayerPatch(key=prefix, format="diff"))
        entry.bias = tensors.pop(prefix + ".diff_b")
        entry.source_keys.append(prefix + ".diff_b")
        found = True
    return "diff" if found else None
