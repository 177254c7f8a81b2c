"""The token layouts of ComfyUI's single-image transformers whose streams meet only inside attention or in one
sequence of a known order: SD3 (`OpenAISignatureMMDITWrapper`), Qwen-Image (`QwenImageTransformer2DModel`) and
Lumina 2 / Z-Image (`NextDiT`)."""

from __future__ import annotations

from ....lora_engine import Layout

from .base import TEXT, Family, rules


class Streams(Family):
    """A transformer whose image and text streams meet only inside attention: each layer takes the latent in
    patches of `patch_size`² (`image`), or no image token (`text`), by its `RULES`."""

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.patch = dm.patch_size

    def layout(self, latent, layer: str, x) -> Layout:
        role = self.role(layer)
        if role == "text":
            return TEXT
        if role != "image":
            raise self.refuse(layer, x, "it is in neither the image nor the text stream")
        return self.placed(layer, x, self.patches(latent, (1, self.patch, self.patch)))


class SD3(Streams):
    """SD3 / SD3.5's MMDiT: each joint block's `x_block` takes the image tokens (the latent in patches of
    `patch_size`², `x_embedder` a conv laid out by its output) and its `context_block` the text; the two meet only
    inside attention, after their own projections. The embeddings of time and pooled text and every adaLN
    modulation are one vector per item."""

    RULES = rules(
        ("text", r"context_embedder|context_processor\..*|joint_blocks\.\d+\.context_block\..*"),
        ("text", r"(t_embedder|y_embedder)\..*|(joint_blocks\.\d+\.x_block|final_layer)\.adaLN_modulation\.\d+"),
        ("image", r"joint_blocks\.\d+\.x_block\..*|final_layer\.linear"),
    )


class QwenImage(Streams):
    """Qwen-Image: the image stream (`img_in`, each block's `to_q/k/v`, `to_out.0`, `img_mlp`, `proj_out`) takes
    the latent in 2×2 patches, the text stream (`txt_norm`, `txt_in`, `add_*_proj`, `to_add_out`, `txt_mlp`) the
    text; they meet only inside attention. The time embedding and the modulations are one vector per item. Refused:
    a call given reference latents (Qwen-Image-Edit), whose tokens follow the latent's in the image stream."""

    RULES = rules(
        ("text", r"txt_norm|txt_in|transformer_blocks\.\d+\.(attn\.(add_[qkv]_proj|to_add_out|norm_added_[qk])|"
                 r"txt_mlp\..*)"),
        ("text", r"time_text_embed\..*|transformer_blocks\.\d+\.(img_mod|txt_mod)\..*|norm_out\.linear"),
        ("image", r"img_in|transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|norm_[qk])|img_mlp\..*)|proj_out"),
    )
    WATCHED = ("ref_latents",)


class Lumina2(Family):
    """Lumina 2 and Z-Image's NextDiT. `x_embedder` takes the latent in patches of `patch_size`²; the noise refiner
    those patches then, in Z-Image, the pad tokens that fill them up to a multiple of `pad_tokens_multiple`; the
    main layers and `final_layer.linear` the caption (its length recorded as the context refiner starts), then the
    image's rows as the noise refiner has them. Pad tokens are no image token (text strength). The caption
    embedder and context refiner take the text; time, pooled text and every adaLN modulation are one vector per
    item. Refused: a call given reference latents or SigLIP features (Z-Image's omni edit)."""

    RULES = rules(
        ("text", r"cap_embedder\..*|context_refiner\..*"),
        ("text", r"(t_embedder|time_text_embed|clip_text_pooled_proj)\..*|"
                 r"((noise_refiner|layers)\.\d+|final_layer)\.adaLN_modulation\.\d+"),
        ("image", r"x_embedder"),
        ("padded", r"noise_refiner\.\d+\..*"),
        ("joint", r"layers\.\d+\..*|final_layer\.linear"),
    )
    WATCHED = ("ref_latents", "ref_contexts", "siglip_feats")

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.patch = dm.patch_size
        self.multiple = dm.pad_tokens_multiple
        self.caption: int | None = None
        if len(dm.context_refiner):
            dm.context_refiner[0].register_forward_pre_hook(self._record, with_kwargs=True)

    def _watch(self, module, args, kwargs):
        super()._watch(module, args, kwargs)
        self.caption = None  # recorded again by this call's context refiner

    def _record(self, module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        self.caption = x.shape[1]

    def layout(self, latent, layer: str, x) -> Layout:
        role = self.role(layer)
        if role == "text":
            return TEXT
        grid = self.patches(latent, (1, self.patch, self.patch))
        n = grid[1] * grid[2]
        pad = (-n) % self.multiple if self.multiple else 0
        if role == "image":
            return self.placed(layer, x, grid)
        if role == "padded":
            return self.placed(layer, x, grid, after=pad)
        if role == "joint":
            if self.caption is None:
                raise self.refuse(layer, x, "its caption's length was not recorded (the model has no context "
                                            "refiner)")
            return self.placed(layer, x, grid, start=self.caption, after=pad)
        raise self.refuse(layer, x, "it is in neither the image nor the caption stream")
