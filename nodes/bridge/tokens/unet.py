"""The token layout of ComfyUI's `UNetModel` (SD1.x, SD2.x, SDXL): each `SpatialTransformer`'s own input grid."""

from __future__ import annotations

import re

from ....lora_engine import Layout

from .base import TEXT, Family

_TEXT = re.compile(r"\.attn2\.to_(k|v)$")  # cross-attention K and V read the text


class UNet(Family):
    """Each `SpatialTransformer` records its input grid as it starts; its layers' rows are that grid. Found regions
    are recorded from every cross-attention (`attn2`), told by its keys, as many as the call's text tokens, and its
    queries, the transformer's input grid (ComfyUI's `activations_shape`); a level whose grid has as many tokens as
    the text is left out, where a self-attention could not be told from it."""

    ENCODERS = ("l", "g", "h")

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.grids: dict[str, tuple[int, int]] = {}
        self.owner: dict[str, str | None] = {}
        self.transformers = [n for n, m in dm.named_modules() if type(m).__name__ == "SpatialTransformer"]
        for n, m in dm.named_modules():
            if type(m).__name__ == "SpatialTransformer":
                m.register_forward_pre_hook(self._record(n), with_kwargs=True)

    @staticmethod
    def attended(latent, text, rows, q, k, heads, skip_reshape, options):
        shape = options.get("activations_shape")
        if skip_reshape or shape is None or len(shape) != 4:
            return None
        grid = (int(shape[2]), int(shape[3]))
        n = grid[0] * grid[1]
        if q.shape[1] != n or k.shape[1] != text or n == text:
            return None
        d = q.shape[-1] // heads
        q_img = q[rows].reshape(-1, n, heads, d).transpose(1, 2)
        k_txt = k[rows].reshape(-1, text, heads, d).transpose(1, 2)
        return q_img, k_txt, grid

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
