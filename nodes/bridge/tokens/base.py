"""What every family's token layout shares: a layer's role from its module name, the latent's grid in patches, and
the checks that refuse a layer rather than place a mask where its rows may not be."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from ....lora_engine import Layout, ShapingError

TEXT = Layout()  # no row is an image token: text tokens, and one vector per item (embeddings, modulations)
_UNKNOWN = object()


def rules(*pairs: tuple[str, str]) -> tuple[tuple[str, re.Pattern], ...]:
    """(role, pattern) pairs, tried in order on a layer's module name (the pattern matches its last components):
    `text` (no row is an image token: text tokens, and the vectors of time, guidance and pooled text and the
    modulations made from them, one per item), `image` (the image tokens alone) or `joint` (text and image tokens
    in one sequence)."""
    return tuple((role, re.compile(rf"(^|\.)({p})$")) for role, p in pairs)


def given(value) -> bool:
    """A forward argument that is passed: not None and not an empty list (ComfyUI's default for none)."""
    return value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0)


class Family:
    """One family's layout. `RULES` give each layer's role; `WATCHED` names the forward arguments whose tokens are no
    part of the latent's grid (reference latents): a masked call given one is refused as it starts. `masked()` says
    whether the call under way samples masked entries. A layer's layout depends on the latent and its input's
    shape alone (the engine keeps it by that shape: `lora_engine.regions.Tokens`)."""

    RULES: tuple[tuple[str, re.Pattern], ...] = ()
    WATCHED: tuple[str, ...] = ()
    gathered = None  # a family whose layers take rows gathered over the call places them: `Tokens.gathered`
    # The text encoders whose tokens the family's attention reads, in the order a prompt's are looked for: the regions
    # LoRAAutoRegions finds are recorded from the calls `attended` picks (nodes/bridge/found.py). Empty: not recorded.
    ENCODERS: tuple[str, ...] = ()

    @staticmethod
    def attended(latent: tuple[int, int], text: int, rows: slice, q, k, heads: int, skip_reshape: bool,
                 options: dict):
        """(the queries of the image tokens [items, heads, n, d], the keys of the text tokens, the image grid (h, w))
        of one attention call that reads the prompt, or None for a call that does not. `latent`: the model call's
        latent grid; `text`: its text tokens; `rows`: its positive chunk; `options`: the call's
        transformer_options."""
        return None

    def __init__(self, dm, name: str, masked: Callable[[], bool] = lambda: True):
        self.name = name
        self.masked = masked
        self.roles: dict[str, str | None] = {}
        if self.WATCHED:
            dm.register_forward_pre_hook(self._watch, with_kwargs=True)

    def _watch(self, module, args, kwargs):
        extra = [k for k in self.WATCHED if given(kwargs.get(k))]
        if extra and self.masked():
            raise ShapingError(f"{self.name} is given {', '.join(extra)} in this call, whose tokens are no part of "
                               "the latent's grid, so a LoRA mask cannot be placed on them",
                               remedy="take LoRAStackMask off the stack for this sampling, or sample without them")

    def role(self, layer: str) -> str | None:
        """The layer's role by the first rule its name matches (None: no rule), looked up once per layer."""
        r = self.roles.get(layer, _UNKNOWN)
        if r is _UNKNOWN:
            r = self.roles[layer] = next((role for role, rule in self.RULES if rule.search(layer)), None)
        return r

    @staticmethod
    def patches(latent: tuple[int, int, int], patch: tuple[int, int, int]) -> tuple[int, int, int]:
        """The latent's grid (frames, height, width) in patches, a partial patch padded to a whole one (ComfyUI's
        `pad_to_patch_size`)."""
        return tuple(math.ceil(n / p) for n, p in zip(latent, patch))

    def placed(self, layer: str, x, grid: tuple[int, int, int], start: int = 0, after: int = 0) -> Layout:
        """The image grid from row `start`, for an input [batch, tokens, channels] of exactly `start` + f·h·w +
        `after` rows; else refused (an input of other rows holds tokens that the latent's grid does not)."""
        if x.dim() != 3:
            raise self.refuse(layer, x, "its input is not [batch, tokens, channels] (a norm over attention heads)")
        rows = start + math.prod(grid) + after
        if x.shape[1] != rows:
            where = f"{start} rows before them and {after} after" if start or after else "no other rows"
            raise self.refuse(layer, x, f"the latent's grid of {'×'.join(map(str, grid))} patches with {where} "
                                        f"makes {rows} rows (reference latents or other tokens add more)")
        return Layout(grid, start)

    def refuse(self, layer: str, x, why: str) -> ShapingError:
        return ShapingError(f"layer {layer!r} of {self.name} takes {tuple(x.shape)}: {why}, so a LoRA mask cannot "
                            "be placed on it", remedy="give this layer a block weight of 0 in the masked LoRA, or "
                                                      "take the mask off")
