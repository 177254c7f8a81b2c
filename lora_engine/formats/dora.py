"""DoRA magnitudes: kohya/LyCORIS `dora_scale` and PEFT `lora_magnitude_vector`,
attached to the weight patch of the same layer."""

from __future__ import annotations

import torch

from ..errors import LoRAFormatError
from ..patches import LayerPatch
from ._util import ParseContext, prefixes

SUFFIXES = (".dora_scale", ".lora_magnitude_vector.default.weight", ".lora_magnitude_vector.weight",
            ".lora_magnitude_vector")


def parse(tensors: dict[str, torch.Tensor], layers: dict[str, LayerPatch], ctx: ParseContext) -> str | None:
    found = False
    for suffix in SUFFIXES:
        for prefix in prefixes(tensors, suffix):
            entry = layers.get(prefix)
            if entry is None or entry.weight is None:
                raise LoRAFormatError("DoRA magnitude without a weight patch for the same layer", path=ctx.path,
                                      key=prefix + suffix, remedy="the file is incomplete; re-export it")
            magnitude = tensors.pop(prefix + suffix)
            if suffix != ".dora_scale":
                # PEFT's magnitude is always per output channel: flat ([out]) on a Linear, [1, out, 1, 1] on a
                # conv, where a 4-D `dora_scale` of that shape would mean the input axis.
                magnitude = magnitude.reshape(-1, 1)
            entry.dora_scale = magnitude
            entry.source_keys.append(prefix + suffix)
            found = True
    return "dora" if found else None
