"""Where a model call's tokens lie, per model family, for masked LoRA entries (`lora_engine.regions`).

The engine lays out a conv's rows by its own output, and asks this package for the layers that take tokens
([batch, tokens, channels]). Each family's layout is read from what ComfyUI hands its modules (a block's input,
`transformer_options`, the model's own patch size), never guessed from a token count; a count only confirms it.
By ComfyUI's diffusion-model class (`FAMILIES`), the module that reads it:
- `UNetModel` (SD1.x, SD2.x, SDXL; unet.py): the rows of every layer inside a `SpatialTransformer` are that
  transformer's input grid, recorded from its input [batch, channels, h, w]; cross-attention K and V
  (`attn2.to_k`, `attn2.to_v`) read the text.
- `Flux`, `Chroma` (flux.py): the latent in patches of `patch_size`² is the image grid; the image stream of the
  double blocks (`img_*`), `img_in` and `final_layer.linear` take image tokens, the text stream (`txt_*`) and
  `txt_in` text ones, and the embeddings and modulations (Chroma's `distilled_guidance_layer`) one vector per
  item, which takes the text strength; the single blocks take the text then the image, split where ComfyUI's
  `img_slice` (its `transformer_options`) says. A call with reference latents (Kontext) has more image tokens
  than the latent: refused.
- `OpenAISignatureMMDITWrapper` (SD3, SD3.5; dit.py): each joint block's `x_block` and `final_layer.linear` take
  the latent in patches, its `context_block` the text; the adaLN modulations are vectors.
- `QwenImageTransformer2DModel` (Qwen-Image; dit.py): the image stream (`img_in`, `to_q/k/v`, `to_out.0`,
  `img_mlp`, `proj_out`) and the text stream (`txt_in`, `add_*_proj`, `to_add_out`, `txt_mlp`); reference
  latents (Qwen-Image-Edit) refused.
- `NextDiT` (Lumina 2, Z-Image; dit.py): `x_embedder` and the noise refiner take the image (then Z-Image's pad
  tokens, text strength), the main layers the caption (its length recorded from the context refiner's input)
  then the image; reference latents refused.
- `WanModel` (Wan 2.1, 2.2; wan.py): the video tokens on ComfyUI's `grid_sizes` (frames, height, width), a mask
  per latent frame where given one; cross-attention K/V on the text and the CLIP image tokens; reference and
  in-context latents refused.
- `HiDreamImageTransformer2DModel` (HiDream-I1, E1; hidream.py): `x_embedder` and the double blocks' image stream
  take the latent in patches, their text stream (`*_t`, `ff_t`) the text; the single blocks the image tokens then
  the text; each routed expert the rows its router gathered, placed at their tokens (`Tokens.gathered`). E1's
  `image_cond` refused.
Every other family (HunyuanVideo, LTX-Video, Wan's VACE, camera, S2V and animate models, …) is refused
before sampling, and a layer that none of these rules places is refused when it runs; neither samples unmasked.
"""

from __future__ import annotations

import functools
import weakref

from ....lora_engine import ShapingError, SlotBank, Tokens

from .base import Family
from .dit import SD3, Lumina2, QwenImage
from .flux import Chroma, Flux
from .hidream import HiDream
from .unet import UNet
from .wan import Wan

# ComfyUI's diffusion-model class name -> (the family's name in messages, its layout)
FAMILIES = {
    "UNetModel": ("UNet (SD1.x, SD2.x, SDXL)", UNet),
    "Flux": ("Flux", Flux),
    "Chroma": ("Chroma", Chroma),
    "OpenAISignatureMMDITWrapper": ("SD3", SD3),
    "QwenImageTransformer2DModel": ("Qwen-Image", QwenImage),
    "NextDiT": ("Lumina 2 / Z-Image", Lumina2),
    "WanModel": ("Wan 2.1 / 2.2", Wan),
    "HiDreamImageTransformer2DModel": ("HiDream", HiDream),
}
STATE = "_multilora_tokens"  # on a diffusion model: its family's layout, made once


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
            known = ", ".join(label for label, _ in FAMILIES.values())
            raise ShapingError(f"a LoRA mask cannot be placed on {model} models: the pack knows the token layout "
                               f"of {known}", remedy="take LoRAStackMask off the stack for this model")
        label, layout = FAMILIES[name]
        family = dm.__dict__[STATE] = layout(dm, label, _masked(root))
    return family


def recorded_family(root) -> str:
    """The name (ComfyUI's diffusion-model class, a key of `FAMILIES`) of `root`'s family, where LoRAAutoRegions
    records its attention (`Family.ENCODERS`); a `ShapingError` for one whose attention the pack does not record."""
    name = type(getattr(root, "diffusion_model", root)).__name__
    family = FAMILIES.get(name, (None, None))[1]
    if family is None or not family.ENCODERS:
        recorded = [label for label, f in FAMILIES.values() if f.ENCODERS]
        raise ShapingError(f"LoRAAutoRegions cannot record the attention of {name} models: the pack records "
                           f"that of {' and '.join(recorded)}", remedy="paint the masks and give them to LoRAStackMask")
    return name


def family_rules(name: str) -> tuple[str, type[Family]]:
    """(the family's name in messages, its rules) by ComfyUI's diffusion-model class name (`FAMILIES`)."""
    return FAMILIES[name]


def _masked(root):
    """Whether `root`'s bank samples masked entries now; the root held weakly (its diffusion model holds this)."""
    ref = weakref.ref(root)

    def masked() -> bool:
        r = ref()
        bank = SlotBank.attached(r) if r is not None else None
        return bank is not None and bank.strengths.active and bank.masked
    return masked


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
    gathered = None if family.gathered is None else functools.partial(family.gathered, latent)
    return Tokens(latent, functools.partial(family.layout, latent), gathered)
