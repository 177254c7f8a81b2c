"""The token layouts of ComfyUI's `Flux` and `Chroma`: the latent in patches of `patch_size`², an image and a text
stream in the double blocks, and the single blocks' one sequence split where ComfyUI's `img_slice` says."""

from __future__ import annotations

import math

from ....lora_engine import Layout

from .base import TEXT, Family, rules

_STREAMS = (
    ("text", r"txt_in|double_blocks\.\d+\.txt_(attn|mlp)\..*"),
    # one vector per item: the embeddings of time, guidance and the pooled text, and the modulations made from them
    ("text", r"(time_in|vector_in|guidance_in)\..*|double_blocks\.\d+\.(img|txt)_mod\.lin|"
             r"single_blocks\.\d+\.modulation\.lin|final_layer\.adaLN_modulation\.\d+"),
    ("image", r"img_in|double_blocks\.\d+\.img_(attn|mlp)\..*|final_layer\.linear"),
    ("joint", r"single_blocks\.\d+\.(linear1|linear2)"),
)


class Flux(Family):
    """The image grid is the latent in patches; the single blocks' split is ComfyUI's `img_slice`, recorded as each
    single block starts. A call with reference latents (Kontext) has more image rows than the latent: refused. Found
    regions are recorded from the double blocks' joint attention: the text tokens first, then the latent in 2×2
    patches."""

    RULES = rules(*_STREAMS)
    ENCODERS = ("t5xxl",)

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.patch = dm.patch_size
        self.split: int | None = None
        for m in dm.single_blocks:
            m.register_forward_pre_hook(self._record, with_kwargs=True)

    @staticmethod
    def attended(latent, text, rows, q, k, heads, skip_reshape, options):
        if options.get("block_type") != "double" or not skip_reshape:
            return None
        h, w = (math.ceil(n / 2) for n in latent)
        if q.shape[2] != text + h * w:
            return None  # reference latents (Kontext) or another layout: nothing of it is placed
        return q[rows, :, text:], k[rows, :, :text], (h, w)

    def _record(self, module, args, kwargs):
        options = kwargs.get("transformer_options") or {}
        split = options.get("img_slice")
        self.split = None if split is None else int(split[0])

    def layout(self, latent, layer: str, x) -> Layout:
        role = self.role(layer)
        if role == "text":
            return TEXT
        grid = self.patches(latent, (1, self.patch, self.patch))
        if role == "image":
            return self.placed(layer, x, grid)
        if role == "joint":
            if self.split is None:
                raise self.refuse(layer, x, "ComfyUI gave its single block no `img_slice`")
            return self.placed(layer, x, grid, start=self.split)
        raise self.refuse(layer, x, "it is neither in the image nor in the text stream")


class Chroma(Flux):
    """Flux's blocks without their modulation Linears: the modulations come from the distilled guidance
    approximator (`distilled_guidance_layer`), whose rows are one per modulation index of each item (text strength)."""

    RULES = rules(("text", r"distilled_guidance_layer\..*"), *_STREAMS)
    ENCODERS = ()  # LoRAAutoRegions does not record its attention
