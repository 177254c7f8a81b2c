"""LoRAAutoRegions in ComfyUI: the attention calls that read the prompt, recorded for a `found.Finder` through
ComfyUI's attention override, and the regions put on the model's bank at find_until, in the same sampling.

ComfyUI's attention functions (`comfy.ldm.modules.attention`, wrapped by `wrap_attn`) hand every call to the
function a model's `transformer_options["optimized_attention_override"]` names, if any. `Recorder` is that
function: it runs the attention as ComfyUI would (or the override it found on the model), returns its output
unchanged, and, in the model calls `ModelCallWrapper` marks for recording (`CALL`), gives the finder the queries of
the image tokens and the keys of the text tokens of the calls that read the prompt. Which calls those are, where
their image tokens lie and which text encoder they read is the family's, among its token rules (`tokens`:
`Family.ENCODERS` and `Family.attended`; a UNet's cross-attentions, Flux's double blocks). Only the rows of the
call's first positive chunk (`cond_or_uncond` 0) are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...lora_engine import Adapter, ShapingError
from ...lora_engine.found import Finder

from .tokens import Family, family_rules, recorded_family

OVERRIDE = "optimized_attention_override"
CALL = "multilora_found_call"  # in a model call's transformer_options: what to record in it (`Call`)


@dataclass
class AutoRegions:
    """A stack's regions to find: the finder, the adapter of each of its subjects, and the text encoder chosen for
    the model sampled and that model's family, by ComfyUI's diffusion-model class name (`check`)."""

    finder: Finder
    adapters: tuple[Adapter, ...]
    encoder: str | None = None
    family: str | None = None  # a key of `tokens.FAMILIES`; its rules are `rules`
    fresh: bool = field(default=False)  # a sampling began: the bank's found regions are to be taken off

    def check(self, root) -> None:
        """Before sampling: the family's attention can be recorded, and the words were found in the tokens of the
        text encoder it reads. Starts the finder for the sampling."""
        name = recorded_family(root)
        label, rules = family_rules(name)
        encoder = self.finder.encoder(rules.ENCODERS)
        if encoder is None:
            raise ShapingError(f"{label} attends to the tokens of its {' or '.join(rules.ENCODERS)} text "
                               f"encoder, and LoRAAutoRegions' prompt was tokenized by "
                               f"{', '.join(sorted(self.finder.tokens)) or 'none'}",
                               remedy="give LoRAAutoRegions the CLIP of the model being sampled")
        self.encoder, self.family = encoder, name
        self.finder.start()
        self.fresh = True

    @property
    def rules(self) -> type[Family]:
        """The family's rules: which attention calls read the prompt, and where their image tokens lie."""
        return family_rules(self.family)[1]

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

    auto_regions: AutoRegions
    latent: tuple[int, int]
    text: int
    rows: slice

    def record(self, q, k, heads: int, skip_reshape: bool, kwargs: dict) -> None:
        options = kwargs.get("transformer_options") or {}
        found = self.auto_regions.rules.attended(self.latent, self.text, self.rows, q, k, heads, skip_reshape, options)
        if found is None:
            return
        q_img, k_txt, grid = found
        scale = kwargs.get("scale", q_img.shape[-1] ** -0.5)
        self.auto_regions.finder.record(self.auto_regions.encoder, q_img, k_txt, scale, grid, self.latent)


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
