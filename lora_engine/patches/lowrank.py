"""Low-rank LoRA: ΔW = c · B · A, with A [r, in, *kernel] and B [out, r], in its naming variants: kohya / LoCon
(`lora_down`, `lora_up`, `lora_mid`, `alpha`), PEFT (`lora_A`, `lora_B`, with or without `.default`) and diffusers
(`.lora.down`, `_lora.down`, `.lora_linear_layer.down`).

The file's alpha/r is computed once, at load, into c; the tensors keep their stored dtype and c is applied when B is
written to a slot. A LoCon `lora_mid` (Tucker core) is folded into A: a 1×1 conv followed by a k×k conv is one k×k
conv. It runs as two small matrix products at runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..errors import LoRAShapeError
from .base import LayerFit, WeightPatch, f32, flat, product_bound
from .keys import ParseContext, finite_scale, pop_alpha, prefixes
from .layer_patch import entry

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


@dataclass(frozen=True)
class LowRank(WeightPatch):
    down: torch.Tensor  # A: [r, in, *kernel]
    up: torch.Tensor  # B: [out, r]; column-major once loaded (`adapter.load_adapter`)
    scale: float  # alpha / r

    @classmethod
    def parse(cls, tensors: dict[str, torch.Tensor], layers: dict, ctx: ParseContext) -> str | None:
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
                layer = entry(layers, prefix, fmt if mid is None else "locon-tucker", ctx.path)
                layer.weight = _low_rank(down, up, mid, alpha, ctx.path, prefix + down_sfx, scale)
                layer.source_keys.extend(consumed)
                if fmt not in found:
                    found.append(fmt)
        return "+".join(found) if found else None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def check(self, layer: LayerFit, path: str, key: str) -> None:
        want_in = tuple(layer.weight_shape[1:])
        got_in = tuple(self.down.shape[1:])
        flat_ok = math.prod(got_in) == math.prod(want_in)
        if (got_in != want_in and not flat_ok) or self.up.shape[0] != layer.size:
            out_slice = layer.out_slice
            raise LoRAShapeError(f"factors down {tuple(self.down.shape)!r} / up {tuple(self.up.shape)!r} do not fit "
                                 f"layer {layer.name!r} (weight {tuple(layer.weight_shape)!r}"
                                 f"{', output slice ' + repr(out_slice) if out_slice else ''})",
                                 path=path, key=key, remedy="the LoRA was trained for another model or model size")

    def narrower_inputs(self, weight_shape: torch.Size) -> int | None:
        """A [r, in, *k] against the layer's [out, in + c, *k]: in, else None."""
        down = self.down
        if down.dim() != len(weight_shape) or down.shape[2:] != weight_shape[2:] or self.up.shape[0] != weight_shape[0]:
            return None
        return down.shape[1] if 0 < down.shape[1] < weight_shape[1] else None

    def widened(self, inputs: int) -> LowRank:
        """A widened to `inputs` by zero columns, [A | 0] (the adapter's own tensors are left as they are)."""
        down = self.down
        pad = down.new_zeros(down.shape[0], inputs - down.shape[1], *down.shape[2:])
        return replace(self, down=torch.cat([down, pad], dim=1))

    def delta(self, shape: torch.Size, device: torch.device | None = None, base: torch.Tensor | None = None
              ) -> torch.Tensor:
        return ((f32(self.up, device) * self.scale) @ flat(f32(self.down, device))).reshape(shape)

    def bound(self, base_max: float | None = None) -> float:
        return abs(self.scale) * product_bound(self.up, self.down, None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.down, self.up)

    @property
    def stored_rank(self) -> int:
        return self.rank

    def stored_factors(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.down, self.up, self.scale


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
