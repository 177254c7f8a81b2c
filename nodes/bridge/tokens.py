"""Where a model call's tokens lie, per model family, for masked LoRA entries (`lora_engine.regions`).

The engine lays out a conv's rows by its own output, and asks this module for the layers that take tokens
([batch, tokens, channels]). Each family's layout is read from what ComfyUI hands its modules, never guessed from
a token count:
- UNets (SD1.x, SD2.x, SDXL: ComfyUI's `UNetModel`): the rows of every layer inside a `SpatialTransformer` are
  that transformer's input grid, recorded from its input [batch, channels, h, w]; cross-attention K and V
  (`attn2.to_k`, `attn2.to_v`) read the text.
- Flux (`Flux`): the latent in patches of `patch_size`² is the image grid; the image stream of the double blocks
  (`img_*`), `img_in` and `final_layer.linear` take image tokens, the text stream (`txt_*`) and `txt_in` text ones,
  and the embeddings and modulations one vector per item, which takes the text strength;
  the single blocks take the text then the image, split where ComfyUI's `img_slice` (its `transformer_options`)
  says. A call with reference latents (Kontext) has more image tokens than the latent: refused.
Every other family is refused before sampling, and a layer that none of these rules places is refused when it
runs; neither samples unmasked.
"""

from __future__ import annotations

import functools
import math
import re

from ...lora_engine import Layout, ShapingError, Tokens

TEXT = Layout()
_UNET_TEXT = re.compile(r"\.attn2\.to_(k|v)$")
_FLUX_IMAGE = re.compile(r"(^|\.)(img_in|double_blocks\.\d+\.img_(attn|mlp)\..*|final_layer\.linear)$")
_FLUX_TEXT = re.compile(r"(^|\.)(txt_in|double_blocks\.\d+\.txt_(attn|mlp)\..*)$")
# one vector per item: the embeddings of time, guidance and the pooled text, and the modulations made from them
_FLUX_VECTOR = re.compile(r"(^|\.)((time_in|vector_in|guidance_in)\..*|double_blocks\.\d+\.(img|txt)_mod\.lin|"
                          r"single_blocks\.\d+\.modulation\.lin|final_layer\.adaLN_modulation\.\d+)$")
_FLUX_JOINT = re.compile(r"(^|\.)single_blocks\.(\d+)\.(linear1|linear2)$")
FAMILIES = {"UNetModel": "UNet (SD1.x, SD2.x, SDXL)", "Flux": "Flux"}
STATE = "_multilora_tokens"  # on a diffusion model: its family's `_Family`, made once


def family_of(root):
    """The token layout of `root`'s diffusion model, made once (hooks that record what its blocks are handed); a
    `ShapingError` for a family whose layout the pack does not know."""
    dm = getattr(root, "diffusion_model", root)
    family = dm.__dict__.get(STATE)
    if family is None:
        name = type(dm).__name__
        if name not in FAMILIES:
            config = getattr(root, "model_config", None)
            model = f"{type(config).__name__} ({name})" if config is not None else name
            raise ShapingError(f"a LoRA mask cannot be placed on {model} models: the pack knows the token layout "
                               f"of {', '.join(FAMILIES.values())}", remedy="take LoRAStackMask off the stack for "
                               "this model")
        family = dm.__dict__[STATE] = (_UNet if name == "UNetModel" else _Flux)(dm, name)
    return family


def check_masks(root, regions, noise_shape) -> None:
    """Before sampling: the family places masks, and each mask batch is one mask, one per latent item, or one per
    latent frame (a video latent [batch, channels, frames, h, w])."""
    family_of(root)
    items = noise_shape[0]
    frames = noise_shape[2] if len(noise_shape) == 5 else 1
    for name, region in regions:
        if region.count not in (1, items, frames):
            raise ShapingError(f"the mask of {name} is a batch of {region.count}, for a latent of {items} item(s)"
                               + (f" and {frames} frames" if frames > 1 else ""),
                               remedy="give one mask, or one per latent item")


def tokens_of(root, x) -> Tokens:
    """The model call's tokens for its latent input x ([batch, channels, (frames,) h, w])."""
    family = family_of(root)
    latent = tuple(x.shape[2:]) if x.dim() == 5 else (1, *x.shape[2:])
    return Tokens(latent, functools.partial(family.layout, latent))


class _Family:
    def __init__(self, dm, name: str):
        self.name = name

    def refuse(self, layer: str, x, why: str) -> ShapingError:
        return ShapingError(f"layer {layer!r} of {self.name} takes {tuple(x.shape)}: {why}, so a LoRA mask cannot "
                            "be placed on it", remedy="give this layer a block weight of 0 in the masked LoRA, or "
                                                      "take the mask off")


class _UNet(_Family):
    """Each `SpatialTransformer` records its input grid as it starts; its layers' rows are that grid."""

    def __init__(self, dm, name):
        super().__init__(dm, name)
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
        if _UNET_TEXT.search(layer):
            return TEXT
        t = self._transformer(layer)
        if t is None or t not in self.grids:
            raise self.refuse(layer, x, "it is outside the UNet's transformer blocks")
        h, w = self.grids[t]
        if x.dim() != 3 or x.shape[1] != h * w:
            raise self.refuse(layer, x, f"its transformer's input grid is {h}×{w}")
        return Layout((1, h, w))


class _Flux(_Family):
    """The image grid is the latent in patches; the single blocks' split is ComfyUI's `img_slice`."""

    def __init__(self, dm, name):
        super().__init__(dm, name)
        self.patch = dm.patch_size
        self.split: int | None = None
        for m in dm.single_blocks:
            m.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        options = kwargs.get("transformer_options") or {}
        split = options.get("img_slice")
        self.split = None if split is None else int(split[0])

    def layout(self, latent, layer: str, x) -> Layout:
        if _FLUX_TEXT.search(layer) or _FLUX_VECTOR.search(layer):
            return TEXT
        p = self.patch
        grid = (1, math.ceil(latent[1] / p), math.ceil(latent[2] / p))
        image = grid[1] * grid[2]
        if _FLUX_IMAGE.search(layer):
            if x.shape[1] != image:
                raise self.refuse(layer, x, f"its rows are not the latent's {image} image tokens (reference "
                                            "latents add more)")
            return Layout(grid)
        if _FLUX_JOINT.search(layer):
            if self.split is None or x.shape[1] - self.split != image:
                raise self.refuse(layer, x, f"its image part is not the latent's {image} tokens")
            return Layout(grid, start=self.split)
        raise self.refuse(layer, x, "it is neither in the image nor in the text stream")
