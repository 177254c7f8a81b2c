"""File layouts -> `LayerPatch` per key prefix.

Each parser takes the file's remaining tensors and the layers found so far,
pops the keys it understands, and returns its format name, or None when the
file holds nothing of its format. Keys that no parser takes become the
adapter's leftover report: nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..patches import LayerPatch
from . import diff, dora, lora, lycoris
from ._util import ParseContext

PARSERS = (lora.parse, lycoris.parse_loha, lycoris.parse_lokr, lycoris.parse_oft, lycoris.parse_boft,
           lycoris.parse_glora, diff.parse, dora.parse)


@dataclass(frozen=True)
class ParsedFile:
    layers: dict[str, LayerPatch]
    formats: tuple[str, ...]
    leftover: tuple[str, ...]


def parse_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> ParsedFile:
    ctx = ParseContext(path, metadata or {})
    remaining = dict(tensors)
    layers: dict[str, LayerPatch] = {}
    formats: list[str] = []
    for parser in PARSERS:
        name = parser(remaining, layers, ctx)
        if name is not None:
            formats.append(name)
    return ParsedFile(layers=layers, formats=tuple(formats), leftover=tuple(sorted(remaining)))
