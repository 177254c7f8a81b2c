"""Per-layer patches: what one adapter file says about one layer, one class per algorithm behind a registry.

`ALGORITHMS` lists the algorithms, each a `base.WeightPatch` subclass in a file of its own that parses its keys,
checks its shapes against a layer, and computes its delta, its bound and its low-rank form. Adding one is that file
and a line here. `parse_tensors` runs their parsers over a file in this order, then the DoRA magnitudes', which
attach to the weight patch of their layer: each parser pops the keys it understands, and keys that no parser takes
become the adapter's leftover report, so that nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dora
from .base import LayerFit, WeightPatch, absmax, finite
from .boft import Boft
from .diff import FullDiff
from .glora import Glora
from .keys import ParseContext
from .layer_patch import LayerPatch
from .loha import LoHa
from .lokr import LoKr
from .lowrank import LowRank
from .oft import Oft

ALGORITHMS: tuple[type[WeightPatch], ...] = (
    LowRank,
    LoHa,
    LoKr,
    Oft,
    Boft,
    Glora,
    FullDiff,
)

PARSERS = tuple(a.parse for a in ALGORITHMS) + (dora.parse,)


@dataclass(frozen=True)
class ParsedFile:
    layers: dict[str, LayerPatch]
    formats: tuple[str, ...]
    leftover: tuple[str, ...]


def parse_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> ParsedFile:
    """The file's tensors as one `LayerPatch` per layer key prefix, the formats found, and the keys left over."""
    ctx = ParseContext(path, metadata or {})
    remaining = dict(tensors)
    layers: dict[str, LayerPatch] = {}
    formats: list[str] = []
    for parser in PARSERS:
        name = parser(remaining, layers, ctx)
        if name is not None:
            formats.append(name)
    return ParsedFile(layers=layers, formats=tuple(formats), leftover=tuple(sorted(remaining)))


__all__ = ["ALGORITHMS", "PARSERS", "Boft", "FullDiff", "Glora", "LayerFit", "LayerPatch", "LoHa", "LoKr", "LowRank",
           "Oft", "ParsedFile", "WeightPatch", "absmax", "finite", "parse_tensors"]
