"""Strengths per token: a mask on a stack entry, resampled to each layer's token grid.

Entry i with mask mᵢ (1 inside, 0 outside), `outside` oᵢ and text strength tᵢ scales each row of a layer by

    gᵢ(token) = m̄ᵢ + oᵢ·(1 − m̄ᵢ)   on an image token, m̄ᵢ being mᵢ area-averaged to the layer's grid;
    gᵢ = tᵢ                       on a row that is no image token (a text token, or one vector per item);

and the layer adds Σᵢ sᵢ · gᵢ(token) · Bᵢ·Aᵢ·x. The factor scales slot i's columns of h = x·A_catᵀ (a [batch, tokens,
N] tensor broadcast over each slot's R columns), so any number of masked entries stay two GEMMs per layer; a dense
or bias slot's output takes the same factor. An entry without a mask has g = 1, and a layer with no masked live
slot computes nothing more.

Where a layer's rows lie is the host's to say, never guessed from a count: per model call it gives the latent's
grid and a layout function (`Tokens`), which tells for a layer that takes tokens (a Linear or a norm over the last
axis, input [batch, tokens…, channels]) which rows are the image grid (`Layout`). A conv (or a GroupNorm) is laid
out by its own output, [batch, channels, (frames,) height, width]; a layer whose input has no token axis
([batch, channels]) takes the text strength.

A layer whose rows are tokens gathered over the call (a mixture of experts' routed rows, input [rows, channels])
is placed by the host too: `Tokens.gathered` gives, per row, its position in the sequence it was gathered from
(`Gathered`), and the row takes the factor of that token.

A mask batch of one applies to every item and frame; of the latent's frame count (a video latent), one per frame;
else one per batch item, tiled over the call's cond and uncond chunks as per-item strengths are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import NonFiniteError, ShapingError, shown


@dataclass(frozen=True, eq=False)
class Region:
    """A mask on one entry: `mask` [M, H, W] in 0…1 at any resolution, the factor `outside` where it is 0, the
    `text` strength of rows that are no image token, and a `feather` (a blur radius in latent pixels)."""

    mask: torch.Tensor
    outside: float = 0.0
    text: float = 0.0
    feather: float = 0.0

    @classmethod
    def of(cls, mask, outside: float = 0.0, text: float = 0.0, feather: float = 0.0, invert: bool = False,
           name: str = "") -> Region:
        """A checked region: the mask as a float [M, H, W] on the host (a [H, W] mask is a batch of one), inverted
        where asked. A `ShapingError` for a mask of another shape or values outside 0…1, a `NonFiniteError` for a
        NaN or Inf."""
        where = f" of {name}" if name else ""
        m = torch.as_tensor(mask).detach().to("cpu", torch.float32)
        if m.dim() == 2:
            m = m.unsqueeze(0)
        if m.dim() != 3 or 0 in m.shape:
            raise ShapingError(f"the mask{where} has shape {tuple(m.shape)}; a mask is [height, width] or a batch "
                               "[masks, height, width]", remedy="connect a MASK output")
        for what, v in (("outside", outside), ("text strength", text), ("feather", feather)):
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise NonFiniteError(f"the mask{where}: {what} must be a finite number, got {shown(v)}")
        if not bool(torch.isfinite(m).all()):
            raise NonFiniteError(f"the mask{where} holds NaN or Inf values", remedy="connect a mask of 0…1 values")
        lo, hi = float(m.min()), float(m.max())
        if lo < 0.0 or hi > 1.0:
            raise ShapingError(f"the mask{where} has values from {lo:g} to {hi:g}; a mask's values are 0…1",
                               remedy="connect a MASK output, or clamp the mask")
        if feather < 0:
            raise ShapingError(f"the mask{where}: feather must be at least 0, got {feather:g}")
        return cls(1.0 - m if invert else m, float(outside), float(text), float(feather))

    @property
    def count(self) -> int:
        return self.mask.shape[0]

    def at(self, latent: tuple[int, int, int]) -> torch.Tensor:
        """The mask at the latent's grid (frames, height, width), feathered: [M, frames or 1, height, width], M = 1
        or one per batch item, frames where the batch is one mask per latent frame."""
        frames, h, w = latent
        m = F.adaptive_avg_pool2d(self.mask.unsqueeze(1), (h, w))  # [M, 1, h, w]
        if self.feather > 0:
            m = blur(m, self.feather)
        if frames > 1 and self.count == frames:
            m = m.permute(1, 0, 2, 3)  # [1, frames, h, w]
        return m


def blur(m: torch.Tensor, radius: float) -> torch.Tensor:
    """A Gaussian blur of [M, 1, h, w] with σ = radius / 2 over 2·⌈radius⌉ + 1 pixels, the edges replicated (a mask
    of ones stays ones)."""
    k = math.ceil(radius)
    x = torch.arange(-k, k + 1, dtype=torch.float32)
    g = torch.exp(-0.5 * (x / (radius / 2)) ** 2)
    g = g / g.sum()
    m = F.pad(m, (k, k, k, k), mode="replicate")
    m = F.conv2d(m, g.reshape(1, 1, 1, -1))
    return F.conv2d(m, g.reshape(1, 1, -1, 1)).clamp(0.0, 1.0)


@dataclass(frozen=True)
class Layout:
    """Where a layer input's image tokens lie on its token axis: rows `start` … `start` + f·h·w − 1 are the grid
    `grid` (frames, height, width) in row-major order, every other row is no image token. `grid` None (`Layout()`): none is."""

    grid: tuple[int, int, int] | None = None
    start: int = 0

    def image_rows(self) -> int:
        return 0 if self.grid is None else math.prod(self.grid)


TEXT = Layout()  # no row is an image token


@dataclass(frozen=True, eq=False)
class Gathered:
    """Rows gathered from a sequence [batch, tokens, channels] laid out by `layout`: row j of the layer's input is
    token `index[j]` of the flattened batch·tokens (item index[j] // tokens)."""

    index: torch.Tensor
    batch: int
    tokens: int
    layout: Layout


@dataclass(frozen=True)
class Tokens:
    """What the host says of one model call: its latent's grid (frames, height, width), and `layout(layer, x)`, the
    `Layout` of a token-taking layer's input x (a `ShapingError` where it cannot say). For one latent, a layer's
    layout depends on its input's shape alone: the engine keeps each layer's factor by that shape until the latent
    or the regions change, and asks again only for a shape it has not seen. `gathered(layer, x)`, where given,
    places a 2-D input whose rows were gathered over the call (`Gathered`, asked at every call: the rows change
    with the input), or says None: the input is one vector per item."""

    latent: tuple[int, int, int]
    layout: Callable[[str, torch.Tensor], Layout]
    gathered: Callable[[str, torch.Tensor], Gathered | None] | None = None


class Masks:
    """The regions of a bank's slots and the per-token factors made from them for the call under way, cached by
    layout and batch until the regions or the latent change."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        self.n, self.dtype, self.device = n, dtype, device
        self.regions: dict[int, Region] = {}
        self.tokens: Tokens | None = None
        self._latent: dict[int, torch.Tensor] = {}  # slot -> its mask at the call's latent
        self._factors: dict[tuple, torch.Tensor] = {}  # by layout and batch
        self._layers: dict[tuple, torch.Tensor] = {}  # (layer, input shape) -> its factor

    def set_regions(self, regions: dict[int, Region], n: int) -> bool:
        """The regions by slot, of `n` slots; the factors are made again where either changed (then True)."""
        if regions == self.regions and n == self.n:
            return False
        self.regions, self.n = dict(regions), n
        self._forget()
        return True

    def _forget(self) -> None:
        self._latent, self._factors, self._layers = {}, {}, {}

    def set_tokens(self, tokens: Tokens | None) -> None:
        """Where the rows of the model calls that follow lie (`Tokens`: the latent's grid, and which rows of a layer's
        input are image tokens), which masked entries need; None: not known (a masked entry then refuses to run).
        Set by the host before each model call (a bank's `strengths.masks`); the factors are made again only where
        the latent's grid changed."""
        if tokens is not None and self.tokens is not None and tokens.latent != self.tokens.latent:
            self._forget()
        self.tokens = tokens

    def to(self, device: torch.device) -> None:
        self.device = device
        self._factors, self._layers = {}, {}

    def factor(self, name: str, model_name: str, geometry, x: torch.Tensor, out: torch.Tensor,
               items: int | None = None) -> torch.Tensor:
        """Layer `name`'s per-token factor for input `x` and output `out`, shaped to scale each slot's columns at once:
        [batch or 1, tokens…, N, 1] for a layer whose channels are last, [batch or 1, N, 1, *spatial] for a conv,
        [rows, N, 1] for rows gathered over the call; made once per layout and batch, and found by the layer and
        its input's shape after that. An input of other rows than the call's `items` is refused unless the host
        places them (`Tokens.gathered`)."""
        if self.tokens is None:
            raise ShapingError(f"layer {name!r} of {model_name} runs with masked LoRA entries, but the host has "
                               "not said where the model call's tokens lie", remedy="set the call's tokens "
                               "(bank.strengths.masks.set_tokens) before the model runs")
        if x.dim() == 2 and geometry.channel_last and self.tokens.gathered is not None:
            rows = self.tokens.gathered(name, x)
            if rows is not None:
                return self._gather(name, model_name, rows)
        if items is not None and x.shape[0] != items:
            raise ShapingError(f"layer {name!r} of {model_name} takes an input of {x.shape[0]} rows in a model call "
                               f"of {items} items: it mixes the items' tokens, so a LoRA mask cannot be placed on "
                               "it", remedy="give this layer a block weight of 0 in the masked LoRA, or take the "
                                            "mask off")
        seen = (name, x.shape)
        f = self._layers.get(seen)
        if f is None:
            f = self._layers[seen] = self._factor(name, model_name, geometry, x, out)
        return f

    def _factor(self, name: str, model_name: str, geometry, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        spatial = not geometry.channel_last
        if spatial:
            if out.dim() < 4:
                raise ShapingError(f"layer {name!r} of {model_name} has an output of shape {tuple(out.shape)}, "
                                   "which a mask cannot place (it is no image grid)",
                                   remedy="give this layer a block weight of 0 in the masked LoRA")
            dims = tuple(out.shape[2:])
            layout = Layout(dims if len(dims) == 3 else (1, *dims))
            middle = dims
        elif x.dim() == 2:
            layout, middle = TEXT, ()
        else:
            middle = tuple(x.shape[1:-1])
            layout = self.tokens.layout(name, x)
            if layout.start + layout.image_rows() > math.prod(middle):
                raise ShapingError(f"layer {name!r} of {model_name} takes {math.prod(middle)} tokens, but the host "
                                   f"places an image grid {layout.grid} from row {layout.start}: the model call's "
                                   "tokens do not match its latent", remedy="sample a latent of the model's own "
                                   "layout, or remove the mask")
        key = (layout, middle, spatial, x.shape[0])
        f = self._factors.get(key)
        if f is None:
            f = self._factors[key] = self._make(name, model_name, layout, middle, spatial, x.shape[0])
        return f

    def _gather(self, name: str, model_name: str, rows: Gathered) -> torch.Tensor:
        """The factor of gathered rows [rows, N, 1]: the factor of the sequence they came from, taken at their
        tokens."""
        image = rows.layout.start + rows.layout.image_rows()
        if image > rows.tokens or rows.index.dim() != 1:
            raise ShapingError(f"layer {name!r} of {model_name} takes rows gathered from {rows.tokens} tokens, but "
                               f"the host places an image grid {rows.layout.grid} from row {rows.layout.start}",
                               remedy="sample a latent of the model's own layout, or remove the mask")
        key = (rows.layout, (rows.tokens,), False, rows.batch)
        f = self._factors.get(key)
        if f is None:
            f = self._factors[key] = self._make(name, model_name, rows.layout, (rows.tokens,), False, rows.batch)
        f = f.expand(rows.batch, *f.shape[1:]).reshape(rows.batch * rows.tokens, self.n, 1)
        return f.index_select(0, rows.index.to(f.device))

    @torch.compiler.disable
    def factor_outside_graph(self, *args) -> torch.Tensor:
        """`factor`, called by a compiled graph as a function of its own: a new mask of the same shape then compiles
        nothing again."""
        return self.factor(*args)

    def _make(self, name, model_name, layout: Layout, middle: tuple, spatial: bool, batch: int) -> torch.Tensor:
        tokens = math.prod(middle)
        items = {r.count for s, r in self.regions.items() if not self._per_frame(r) and r.count > 1}
        if len(items) > 1:
            raise ShapingError(f"masks of different batch sizes ({sorted(items)}) on the LoRAs of {model_name}",
                               remedy="give every masked LoRA one mask, or one per batch item")
        m = items.pop() if items else 1
        if batch % m:
            raise ShapingError(f"layer {name!r} of {model_name} runs a batch of {batch} rows, but a mask batch "
                               f"holds {m} masks: a mask batch is one mask, one per batch item or one per video "
                               "frame", remedy="give one mask per latent item")
        f = torch.ones((m, tokens, self.n), dtype=torch.float32)
        image = slice(layout.start, layout.start + layout.image_rows())
        for slot, region in self.regions.items():
            if slot >= self.n:
                continue
            f[:, :, slot] = region.text
            if layout.grid is not None:
                f[:, image, slot] = self._on_grid(slot, region, layout.grid).reshape(-1, layout.image_rows())
        if m > 1 and batch != m:
            f = f.repeat(batch // m, 1, 1)
        if spatial:
            f = f.transpose(1, 2)
        f = f.reshape(f.shape[0], *((self.n, 1, *middle) if spatial else (*middle, self.n, 1)))
        return f.to(device=self.device, dtype=self.dtype)

    def _per_frame(self, region: Region) -> bool:
        frames = self.tokens.latent[0]
        return frames > 1 and region.count == frames

    def _on_grid(self, slot: int, region: Region, grid: tuple[int, int, int]) -> torch.Tensor:
        """The region's factor on an image grid: [M, f·h·w], area-averaged from its mask at the latent."""
        latent = self._latent.get(slot)
        if latent is None:
            latent = self._latent[slot] = region.at(self.tokens.latent)
        frames = grid[0] if latent.shape[1] > 1 else 1
        m = F.adaptive_avg_pool3d(latent.unsqueeze(1), (frames, grid[1], grid[2])).squeeze(1)
        m = m.expand(m.shape[0], grid[0], grid[1], grid[2])
        return m + region.outside * (1.0 - m)
