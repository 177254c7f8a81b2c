"""DoRA magnitudes: kohya/LyCORIS `dora_scale` and PEFT `lora_magnitude_vector`, attached to the weight patch of the
same layer (`LayerPatch.dora_scale`).

With W' = W + ΔW, the decomposed weight is W_d = m ⊙ W' / ‖W'‖ (norm over every axis but the magnitude's), as DoRA,
LyCORIS and PEFT define it, and strength s moves linearly from W to W_d, as in ComfyUI: ΔW_dora = W_d − W, applied
as s · ΔW_dora. (ComfyUI 0.28's LoraLoader divides a magnitude on the output axis by ‖W‖, the base weight's norm,
instead. LyCORIS blends only the normalisation, (W + ΔW) ⊙ (s·(m/‖W + ΔW‖ − 1) + 1), which agrees at s = 1 only:
its s = 0 is W + ΔW; docs/lycoris.md.)
"""

from __future__ import annotations

import torch

from ..errors import LoRAFormatError, LoRAShapeError
from .base import LayerFit, flat
from .keys import ParseContext, prefixes

SUFFIXES = (".dora_scale", ".lora_magnitude_vector.default.weight", ".lora_magnitude_vector.weight",
            ".lora_magnitude_vector")


def parse(tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
    """Attach each magnitude to `layers[prefix]` (`LayerPatch`), which must already hold a weight patch."""
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


def check_magnitude(magnitude: torch.Tensor, layer: LayerFit, path: str, key: str) -> None:
    """A magnitude holds one value per output row, or one per input channel (LyCORIS's `wd_on_output=False`), as
    `dora_delta` reads it; any other is refused."""
    size = layer.size
    inputs = layer.weight_shape[1] if len(layer.weight_shape) > 1 else None
    if (magnitude.dim() and magnitude.shape[0] == size and magnitude.numel() == size) or \
            (inputs is not None and magnitude.numel() == inputs):
        return
    per_input = f" nor one per input ({inputs})" if inputs is not None else ""
    raise LoRAShapeError(f"DoRA magnitude {tuple(magnitude.shape)!r} does not fit {layer.described}: it holds "
                         f"neither one value per output ({size}){per_input}", path=path, key=key,
                         remedy="the adapter was trained for another model or model size, or its file is damaged")


def dora_delta(w: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """ΔW_dora = m ⊙ (W + ΔW) / ‖W + ΔW‖ − W in fp32 (the module docstring)."""
    merged = w + delta
    if magnitude.shape[0] == merged.shape[0] and magnitude.numel() == merged.shape[0]:
        norm = flat(merged).norm(dim=1).reshape(merged.shape[0], *[1] * (merged.dim() - 1))
        magnitude = magnitude.reshape(norm.shape)
    else:
        norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
        norm = norm.reshape(1, merged.shape[1], *[1] * (merged.dim() - 2))
        magnitude = magnitude.reshape(norm.shape)
    eps = torch.finfo(torch.float32).eps
    return merged * (magnitude / (norm + eps)) - w
