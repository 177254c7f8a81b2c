"""The token layout of ComfyUI's HiDream (`HiDreamImageTransformer2DModel`): the latent in patches, an image and a
text stream in the double blocks, one sequence of the image then the text in the single blocks, and the routed
experts' rows, which the router gathers from their block's sequence."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from ....lora_engine import Gathered, Layout

from .base import TEXT, Family, rules

_MOE = re.compile(r"((?:double|single)_stream_blocks\.\d+\.block\.ff_i)\.experts\.(\d+)\.(w[123])$")


@dataclass
class _Route:
    """One mixture of experts' call under way: its input [batch, tokens, channels] and the router's choice of
    experts per token (flattened, `k` per token); each expert's rows, made once per call."""

    source: torch.Tensor
    chosen: torch.Tensor | None = None
    k: int = 0
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    checked: set[int] = field(default_factory=set)


class HiDream(Family):
    """HiDream-I1 and E1. `x_embedder` and the double blocks' image stream (`attn1.to_q/k/v/out`, the shared and
    routed experts of `ff_i`) take the latent in patches of `patch_size`², the text stream (`*_t`, `ff_t`) and the
    caption projections the text; the single blocks take one sequence, the image tokens (as many as `x_embedder`
    made) then the text. Time, pooled text and the adaLN modulations are one vector per item.

    A routed expert takes the rows that ComfyUI's `MOEFeedForwardSwiGLU` gathers from its block's sequence for it:
    those of the tokens whose top k experts (the gate's output, recorded as it returns) include it, in the order
    of the tokens, each once per choice. Each expert's first input is compared with those rows of the block's
    input, so that another order of gathering is refused, never masked at the wrong tokens. Refused: a call given
    `image_cond` (E1's reference image, which widens the image tokens)."""

    RULES = rules(
        ("text", r"t_embedder\..*|p_embedder\..*|caption_projection\.\d+\..*|final_layer\.adaLN_modulation\.\d+|"
                 r"(double|single)_stream_blocks\.\d+\.block\.adaLN_modulation\.\d+"),
        ("text", r"double_stream_blocks\.\d+\.block\.(attn1\.(to_[qkv]_t|to_out_t|[qk]_rms_norm_t)|ff_t\..*)"),
        ("experts", r"(double|single)_stream_blocks\.\d+\.block\.ff_i\.experts\.\d+\.w[123]"),
        ("image", r"x_embedder\..*|double_stream_blocks\.\d+\.block\.(attn1|ff_i)\..*|final_layer\.linear"),
        ("joint", r"single_stream_blocks\.\d+\.block\.(attn1|ff_i)\..*"),
    )
    WATCHED = ("image_cond",)

    def __init__(self, dm, name, masked):
        super().__init__(dm, name, masked)
        self.patch = dm.patch_size
        self.image: int | None = None  # the image tokens of the call under way, as x_embedder made them
        self.routes: dict[str, _Route] = {}
        dm.x_embedder.register_forward_hook(self._embedded)
        for moe_name, m in dm.named_modules():
            if hasattr(m, "gate") and hasattr(m, "experts"):
                m.register_forward_pre_hook(lambda module, args, n=moe_name: self._enter(n, args))
                m.register_forward_hook(lambda module, args, out, n=moe_name: self._left(n), always_call=True)
                m.gate.register_forward_hook(lambda module, args, out, n=moe_name: self._routed(n, out))

    def _embedded(self, module, args, out) -> None:
        self.image = out.shape[1]

    def _enter(self, moe: str, args) -> None:
        if self.masked() and args:
            self.routes[moe] = _Route(args[0])

    def _left(self, moe: str) -> None:
        self.routes.pop(moe, None)  # the block's input is not held past its call

    def _routed(self, moe: str, out) -> None:
        route = self.routes.get(moe)
        if route is not None:
            chosen = out[0]
            route.chosen, route.k = chosen.reshape(-1), chosen.shape[-1]

    def sequence(self, latent, layer: str, x) -> Layout:
        """The layout of a sequence [batch, tokens, channels] in the image stream (double blocks) or of a single
        block's image then text."""
        grid = self.patches(latent, (1, self.patch, self.patch))
        if "single_stream_blocks." not in layer:
            return self.placed(layer, x, grid)
        if x.dim() != 3 or self.image != math.prod(grid):
            raise self.refuse(layer, x, f"its sequence starts with {self.image} image tokens, where the latent's "
                                        f"grid makes {math.prod(grid)}")
        return self.placed(layer, x, grid, after=x.shape[1] - self.image)

    def layout(self, latent, layer: str, x) -> Layout:
        role = self.role(layer)
        if role == "text":
            return TEXT
        if role in ("image", "joint"):
            return self.sequence(latent, layer, x)
        if role == "experts":
            raise self.refuse(layer, x, "a routed expert's input is not [rows, channels]")
        raise self.refuse(layer, x, "it is neither in the image nor in the text stream")

    def gathered(self, latent, layer: str, x) -> Gathered | None:
        """Where a routed expert's rows came from; None for another layer's one vector per item."""
        found = _MOE.search(layer)
        if found is None:
            return None
        moe, expert = found.group(1), int(found.group(2))
        route = self.routes.get(moe)
        if route is None or route.chosen is None:
            raise self.refuse(layer, x, "its mixture of experts was entered without the router's choice recorded")
        rows = route.rows.get(expert)
        if rows is None:
            rows = route.rows[expert] = torch.nonzero(route.chosen == expert).squeeze(1) // route.k
        if x.shape[0] != rows.numel():
            raise self.refuse(layer, x, f"the router chose expert {expert} for {rows.numel()} rows")
        source = route.source
        if expert not in route.checked and found.group(3) != "w2":  # w1 and w3 take the gathered rows themselves
            if not torch.equal(x, source.reshape(-1, source.shape[-1]).index_select(0, rows)):
                raise self.refuse(layer, x, "its rows are not the routed tokens in the order ComfyUI's mixture of "
                                            "experts gathers them")
            route.checked.add(expert)
        return Gathered(rows, source.shape[0], source.shape[1], self.sequence(latent, moe, source))
