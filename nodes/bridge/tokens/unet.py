"""The token layout of ComfyUI's `UNetModel` (SD1.x, SD2.x, SDXL): each `SpatialTransformer`'s own input grid."""

from __future__ import annotations

import re

from ....lora_engine import Layout

from .base import TEXT, Family

_TEXT = re.compile(r"\.attn2\.to_(k|v)$")  # cross-attention K and V read the text


class UNet(Family):
    """Each `SpatialTransformer` records its input grid as it starts; its layers' rows are that grid."""

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.grids: dict[str, tuple[int, int]] = {}
        self.owner: dict[str, str | None] = {}
        self.transformers = [n for n, m in dm.named_modules() if type(m).__name__ == "SpatialTransformer"]
        for n, m in dm.named_modules():
            if type(m).__name__ == "SpatialTransformer":
                m.register_forward_pre_hook(self._record(n), with_kwargs=True)

    def _record(self, name):
        def record(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            self.grids[name] = tuple(x.shape[-2:])
        return record

    def _transformer(self, layer: str) -> str | None:
        if layer not in self.owner:
            self.owner[layer] = next((t for t in self.transformers if f".{t}." in f".{layer}"), None)
        return self.owner[layer]

    def layout(self, latent, layer: str, x) -> Layout:
        if _TEXT.search(layer):
            return TEXT
        t = self._transformer(layer)
        if t is None or t not in self.grids:
            raise self.refuse(layer, x, "it is outside the UNet's transformer blocks")
        h, w = self.grids[t]
        if x.dim() != 3 or x.shape[1] != h * w:
            raise self.refuse(layer, x, f"its transformer's input grid is {h}×{w}")
        return Layout((1, h, w))
