"""LoRAAutoRegions in ComfyUI: the attention calls that read the prompt, recorded for a `found.Finder` through
ComfyUI's attention override, and the regions put on the model's bank at find_until, in the same sampling.

ComfyUI's attention functions (`comfy.ldm.modules.attention`, wrapped by `wrap_attn`) hand every call to the
function a model's `transformer_options["optimized_attention_override"]` names, if any. `Recorder` is that
function: it runs the attention as ComfyUI would (or the override it found on the model), returns its output
unchanged, and, in the model calls `ModelCallWrapper` marks for recording (`CALL`), gives the finder the queries of
the image tokens and the keys of the text tokens of the calls that read the prompt:
- a UNet (SD1.x, SD2.x, SDXL): every cross-attention (`attn2`), told by its keys, as many as the call's text
  tokens, and its queries, the transformer's input grid (ComfyUI's `activations_shape`); a level whose grid has
  as many tokens as the text is left out, where a self-attention could not be told from it;
- Flux: the double blocks' joint attention, the text tokens first, then the latent in 2×2 patches.
Only the rows of the call's first positive chunk (`cond_or_uncond` 0) are recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...lora_engine import Adapter, ShapingError
from ...lora_engine.found import Finder

OVERRIDE = "optimized_attention_override"
CALL = "multilora_found_call"  # in a model call's transformer_options: what to record in it (`Call`)
ENCODERS = {"UNetModel": ("l", "g", "h"), "Flux": ("t5xxl",)}  # the text encoder whose tokens each family attends to
LABELS = {"UNetModel": "UNet (SD1.x, SD2.x, SDXL)", "Flux": "Flux"}


@dataclass
class Finding:
    """A stack's regions to find: the finder, the adapter of each of its subjects, and the text encoder chosen for
    the model sampled (`check`)."""

    finder: Finder
    adapters: tuple[Adapter, ...]
    encoder: str | None = None
    family: str | None = None
    fresh: bool = field(default=False)  # a sampling began: the bank's found regions are to be taken off

    def check(self, root) -> None:
        """Before sampling: the family's attention can be recorded, and the words were found in the tokens of the
        text encoder it reads. Starts the finder for the sampling."""
        dm = getattr(root, "diffusion_model", root)
        name = type(dm).__name__
        if name not in ENCODERS:
            raise ShapingError(f"LoRAAutoRegions cannot record the attention of {name} models: the pack records "
                               f"that of {' and '.join(LABELS.values())}",
                               remedy="paint the masks and give them to LoRAStackMask")
        encoder = self.finder.encoder(ENCODERS[name])
        if encoder is None:
            raise ShapingError(f"{LABELS[name]} attends to the tokens of its {' or '.join(ENCODERS[name])} text "
                               f"encoder, and LoRAAutoRegions' prompt was tokenized by "
                               f"{', '.join(sorted(self.finder.tokens)) or 'none'}",
                               remedy="give LoRAAutoRegions the CLIP of the model being sampled")
        self.encoder, self.family = encoder, name
        self.finder.start()
        self.fresh = True

    def before_call(self, bank, progress: float, x: torch.Tensor, context, transformer_options: dict) -> dict:
        """At each model call: the regions found at find_until and put on `bank`; the call's transformer_options,
        marked for recording before it."""
        if self.fresh:
            bank.set_found({})
            self.fresh = False
        finder = self.finder
        if finder.due(progress):
            finder.find()
            bank.set_found(dict(zip(self.adapters, finder.regions())))
            return transformer_options
        if not finder.recording(progress) or context is None or self.encoder is None:
            return transformer_options
        chunks = list(transformer_options.get("cond_or_uncond") or [0])
        if 0 not in chunks or x.shape[0] % len(chunks):
            return transformer_options
        items = x.shape[0] // len(chunks)
        start = chunks.index(0) * items
        call = Call(self, tuple(x.shape[-2:]), context.shape[1], slice(start, start + items))
        return {**transformer_options, CALL: call}


@dataclass(frozen=True)
class Call:
    """What one model call records: its latent's grid, its text's token count, and the rows of its positive chunk."""

    finding: Finding
    latent: tuple[int, int]
    text: int
    rows: slice

    def record(self, q, k, heads: int, skip_reshape: bool, kwargs: dict) -> None:
        options = kwargs.get("transformer_options") or {}
        if self.finding.family == "Flux":
            if options.get("block_type") != "double" or not skip_reshape:
                return
            h, w = (math.ceil(n / 2) for n in self.latent)
            if q.shape[2] != self.text + h * w:
                return  # reference latents (Kontext) or another layout: nothing of it is placed
            q_img, k_txt, grid = q[self.rows, :, self.text:], k[self.rows, :, : self.text], (h, w)
        else:
            shape = options.get("activations_shape")
            if skip_reshape or shape is None or len(shape) != 4:
                return
            grid = (int(shape[2]), int(shape[3]))
            n = grid[0] * grid[1]
            if q.shape[1] != n or k.shape[1] != self.text or n == self.text:
                return
            d = q.shape[-1] // heads
            q_img = q[self.rows].reshape(-1, n, heads, d).transpose(1, 2)
            k_txt = k[self.rows].reshape(-1, self.text, heads, d).transpose(1, 2)
        scale = kwargs.get("scale", q_img.shape[-1] ** -0.5)
        self.finding.finder.record(self.finding.encoder, q_img, k_txt, scale, grid, self.latent)


class Recorder:
    """ComfyUI's `optimized_attention_override` on a model whose stack finds regions (the module docstring)."""

    def __init__(self, prior=None):
        self.prior = prior  # the override the model had, called in its place

    def __call__(self, func, *args, **kwargs):
        out = self.prior(func, *args, **kwargs) if self.prior is not None else func(*args, **kwargs)
        options = kwargs.get("transformer_options")
        call = options.get(CALL) if isinstance(options, dict) else None
        if call is not None and len(args) >= 4:
            q, k, _v, heads = args[:4]
            call.record(q, k, int(heads), bool(kwargs.get("skip_reshape", False)), kwargs)
        return out


def install(clone) -> None:
    """The recorder as `clone`'s attention override, around the override it had (one of another pack)."""
    options = dict(clone.model_options.get("transformer_options", {}))
    prior = options.get(OVERRIDE)
    if isinstance(prior, Recorder):
        prior = prior.prior
    options[OVERRIDE] = Recorder(prior)
    clone.model_options["transformer_options"] = options
