"""The token layout of ComfyUI's `WanModel` (Wan 2.1 and 2.2, text and image to video): the video latent in patches
of `patch_size` (frames, height, width), a grid that ComfyUI puts in `transformer_options["grid_sizes"]`."""

from __future__ import annotations

from ....lora_engine import Layout

from .base import TEXT, Family, rules


class Wan(Family):
    """Self-attention, the cross-attention's query and output, the feed-forward and the head take the video tokens
    in ComfyUI's `grid_sizes`, recorded as each block starts; the cross-attention's K and V take the text (and, for
    image to video, the CLIP image embedding's tokens: conditioning rows, text strength); the time embedding and
    its projection are one vector per item (or per frame, where Wan 2.2 gives each frame its timestep). Refused:
    calls given reference latents, in-context latents or frames concatenated in time (`time_dim_concat`), whose
    tokens or frames are no part of the latent."""

    RULES = rules(
        ("text", r"text_embedding\..*|img_emb\..*|blocks\.\d+\.cross_attn\.(k|v|norm_k|k_img|v_img|norm_k_img)"),
        ("text", r"(time_embedding|time_projection)\..*"),
        ("image", r"blocks\.\d+\.(self_attn\..*|cross_attn\.(q|o|norm_q)|norm3|ffn\.\d+)|head\.head"),
    )
    WATCHED = ("reference_latent", "context_latents", "time_dim_concat")

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.patch = tuple(dm.patch_size)
        self.grid: tuple[int, int, int] | None = None
        for m in dm.blocks:
            m.register_forward_pre_hook(self._record, with_kwargs=True)

    def _watch(self, module, args, kwargs):
        super()._watch(module, args, kwargs)
        self.grid = None  # recorded again by this call's blocks

    def _record(self, module, args, kwargs):
        grid = (kwargs.get("transformer_options") or {}).get("grid_sizes")
        self.grid = None if grid is None else tuple(int(n) for n in grid)

    def layout(self, latent, layer: str, x) -> Layout:
        role = self.role(layer)
        if role == "text":
            return TEXT
        if role != "image":
            raise self.refuse(layer, x, "it is neither in the video nor in the text stream")
        grid = self.patches(latent, self.patch)
        if self.grid is None:
            raise self.refuse(layer, x, "ComfyUI gave its block no `grid_sizes`")
        if self.grid != grid:
            raise self.refuse(layer, x, f"ComfyUI's grid_sizes {self.grid} are not the latent's {grid} patches")
        return self.placed(layer, x, grid)
