"""Full-weight diffs: `.diff` (ΔW) and `.diff_b` (Δbias); LyCORIS names a norm layer's `.w_norm` and `.b_norm`."""

from __future__ import annotations

import torch

from ..patches import FullDiff, LayerPatch
from ._util import ParseContext, layer, prefixes


SUFFIXES = ((".diff", ".diff_b"), (".w_norm", ".b_norm"))


def parse(tensors: dict[str, torch.Tensor], layers: dict[str, LayerPatch], ctx: ParseContext) -> str | None:
    found = False
    for weight, bias in SUFFIXES:
        for prefix in prefixes(tensors, weight):
            entry = layer(layers, prefix, "diff", ctx.path)
            entry.weight = FullDiff(tensors.pop(prefix + weight))
            entry.source_keys.append(prefix + weight)
            found = True
        for prefix in prefixes(tensors, bias):
            entry = layers.get(prefix) or layers.setdefault(prefix, LayerPatch(key=prefix, format="diff"))
            entry.bias = tensors.pop(prefix + bias)
            entry.source_keys.append(prefix + bias)
            found = True
    return "diff" if found else None
