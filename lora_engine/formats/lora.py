"""Low-rank LoRA in its naming variants: kohya / LoCon (`lora_down`, `lora_up`,
`lora_mid`, `alpha`), PEFT (`lora_A`, `lora_B`, with or without `.default`) and
diffusers (`.lora.down`, `_lora.down`, `.lora_linear_layer.down`)."""

from __future__ import annotations

import torch

from ..errors import LoRAShapeError
from ..patches import LowRank
from ._util import ParseContext, finite_scale, layer, pop_alpha, prefixes

# (format, up suffix, down suffix); longer suffixes first, so that `.lora_B` is tried last.
VARIANTS = (
    ("kohya", ".lora_up.weight", ".lora_down.weight"),
    ("peft", ".lora_B.default.weight", ".lora_A.default.weight"),
    ("peft", ".lora_B.weight", ".lora_A.weight"),
    ("diffusers", ".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    ("diffusers", ".lora.up.weight", ".lora.down.weight"),
    ("diffusers-old", "_lora.up.weight", "_lora.down.weight"),
    ("peft", ".lora_B", ".lora_A"),
)


def parse(tensors: dict[str, torch.Tensor], layers, ctx: ParseContext) -> str | None:
    found: list[str] = []
    for fmt, up_sfx, down_sfx in VARIANTS:
        for prefix in prefixes(tensors, down_sfx):
            if prefix + up_sfx not in tensors:
                continue
            consumed = [prefix + down_sfx, prefix + up_sfx]
            down = tensors.pop(prefix + down_sfx)
            up = tensors.pop(prefix + up_sfx)
            mid_key = prefix + ".lora_mid.weight"
            mid = tensors.pop(mid_key, None)
            if mid is not None:
                consumed.append(mid_key)
            alpha = pop_alpha(tensors, prefix, consumed)
            scale = None
            if alpha is None and fmt == "peft" and down.dim() >= 2:  # other shapes are refused below
                scale = ctx.peft_scale(prefix, down.shape[0])
            entry = layer(layers, prefix, fmt if mid is None else "locon-tucker", ctx.path)
            entry.weight = _low_rank(down, up, mid, alpha, ctx.path, prefix + down_sfx, scale)
            entry.source_keys.extend(consumed)
            if fmt not in found:
                found.append(fmt)
    return "+".join(found) if found else None


def _low_rank(down: torch.Tensor, up: torch.Tensor, mid: torch.Tensor | None, alpha: float | None,
              path: str, key: str, scale: float | None = None) -> LowRank:
    if down.dim() < 2 or up.dim() < 2 or down.shape[0] == 0:
        raise LoRAShapeError(f"down {tuple(down.shape)!r} / up {tuple(up.shape)!r} are not LoRA factors",
                             path=path, key=key)
    if up.dim() > 2:
        if any(d != 1 for d in up.shape[2:]):
            raise LoRAShapeError(f"up factor {tuple(up.shape)!r} has a spatial kernel; only 1x1 is supported",
                                 path=path, key=key)
        up = up.reshape(up.shape[0], up.shape[1])
    rank = down.shape[0]
    if mid is not None:
        if mid.dim() < 3 or mid.shape[0] != up.shape[1] or mid.shape[1] != rank:
            raise LoRAShapeError(f"lora_mid {tuple(mid.shape)!r} does not fit down {tuple(down.shape)!r}",
                                 path=path, key=key)
        down = torch.einsum("ij...,jn->in...", mid.float(), down.float().reshape(rank, -1))
        rank = down.shape[0]
    if up.shape[1] != rank:
        raise LoRAShapeError(f"rank mismatch: down {tuple(down.shape)!r}, up {tuple(up.shape)!r}",
                             path=path, key=key)
    if scale is None:
        scale = alpha / rank if alpha is not None else 1.0
    return LowRank(down=down, up=up, scale=finite_scale(scale, path, key))
