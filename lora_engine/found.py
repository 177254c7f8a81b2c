"""Regions found from attention: each image token given to the stack entry whose words it attends to most.

In the first steps of a sampling the host hands `Finder.record` the queries of the image tokens and the keys of
the text tokens of the attention calls it records (a UNet's cross-attention, the image-to-text part of a joint
block), per head. Each image token's attention over the text tokens (a softmax over the text keys: for a
cross-attention, the model's own weights) is summed over the positions of each entry's words, averaged over the
heads and the words, resampled to the latent's grid and added up over the calls.

`find` then scales each entry's map to its own peak, blurs it by `smooth` (latent pixels), and gives each token
to the entry with the highest value above `threshold`; a token that no entry takes goes to every entry or to none
(`background`). The masks are binary, one per batch item, at the latent's grid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import NonFiniteError, ShapingError, shown
from .regions import Region, blur

BACKGROUNDS = ("off", "at strength")  # where no entry takes a token: the entries' LoRAs off, or at their strengths


class PromptLengthError(ShapingError):
    """The model reads a text of `read` tokens, no whole multiple of the `given` tokens of the prompt the finder was
    given (tokenized by `encoder`): that prompt is not the one sampled. A host says it in its own terms (the
    pack's bridge names the node that took the prompt) from these fields."""

    read: int
    given: int
    encoder: str

    @classmethod
    def of(cls, read: int, given: int, encoder: str) -> PromptLengthError:
        e = cls(f"the model reads a text of {read} tokens, but the prompt given to the finder has {given} "
                f"({encoder}): the words are not where it looks for them",
                remedy="give the finder the positive prompt's own text")
        e.read, e.given, e.encoder = read, given, encoder
        return e


class NothingRecordedError(ShapingError):
    """`find` before any attention call was recorded: no call of the model read the prompt's text."""

    @classmethod
    def of(cls) -> NothingRecordedError:
        return cls("the finder recorded no attention before find_until: no attention call of the model read the "
                   "prompt's text", remedy="check that the prompt is the positive conditioning's, or paint the masks")


@dataclass(frozen=True, eq=False)
class Subject:
    """One entry whose region is sought: its name, and the positions of its words among the prompt's text tokens,
    per text encoder (ComfyUI's tokenizer keys: "l", "g", "t5xxl")."""

    name: str
    words: Mapping[str, tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class AutoRegion:
    """A stack entry's mark: its region is the one `finder` finds for subject `index`."""

    finder: Finder
    index: int

    @property
    def subject(self) -> Subject:
        return self.finder.subjects[self.index]


class Finder:
    """The regions of `subjects`, found in each sampling: recorded until the progress `until` (0…1), found then.
    `tokens`: the prompt's length in tokens per text encoder. `text`: the found regions' text strength
    (`regions.Region`)."""

    def __init__(self, subjects: Sequence[Subject], tokens: Mapping[str, int], until: float = 0.25,
                 threshold: float = 0.3, smooth: float = 1.0, background: str = "off", text: float = 0.0):
        for what, v, lo, hi in (("find_until", until, 0.0, 1.0), ("threshold", threshold, 0.0, 1.0),
                                ("smooth", smooth, 0.0, 64.0), ("text_strength", text, 0.0, 1.0)):
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise NonFiniteError(f"{what} must be a finite number, got {shown(v)}")
            if not lo <= v <= hi:
                raise ShapingError(f"{what} is {v:g}; it is from {lo:g} to {hi:g}")
        if until == 0:
            raise ShapingError("find_until is 0: no step would be recorded", remedy="give a share of the steps "
                                                                                   "above 0")
        if background not in BACKGROUNDS:
            raise ShapingError(f"background is {shown(background)}; it is one of {', '.join(BACKGROUNDS)}")
        if not subjects:
            raise ShapingError("no entry to find a region for", remedy="give the entries' words")
        self.subjects = tuple(subjects)
        self.tokens = dict(tokens)
        self.until, self.threshold, self.smooth = float(until), float(threshold), float(smooth)
        self.background, self.text = background, float(text)
        self.start()

    def region(self, index: int) -> AutoRegion:
        return AutoRegion(self, index)

    def start(self) -> None:
        """A new sampling: nothing recorded, nothing found."""
        self.sums: torch.Tensor | None = None  # [subjects, items, h, w]
        self.calls = 0
        self.found: torch.Tensor | None = None  # [subjects, items, h, w] of 0 and 1

    def recording(self, progress: float) -> bool:
        """The model call at this progress is recorded: before `until`, and no region found yet."""
        return self.found is None and progress < self.until

    def due(self, progress: float) -> bool:
        """The regions are to be found before the call at this progress."""
        return self.found is None and progress >= self.until

    def encoder(self, preferred: Sequence[str]) -> str | None:
        """The first of the `preferred` text encoders whose tokens every subject's words were found in."""
        return next((e for e in preferred if e in self.tokens and all(e in s.words for s in self.subjects)), None)

    @torch.no_grad()
    def record(self, encoder: str, q: torch.Tensor, k: torch.Tensor, scale: float, grid: tuple[int, int],
               latent: tuple[int, int]) -> None:
        """Add one attention call: `q` [items, heads, grid tokens, d] the image tokens' queries (row-major on `grid`),
        `k` [items, heads, text tokens, d] the text tokens' keys of `encoder`, whose count is the prompt's or a
        whole multiple of it (ComfyUI repeats a context to batch it with a longer one). A `ShapingError` for a text
        of another length: the prompt given is not the one sampled (`PromptLengthError`)."""
        items, heads, n_image, _ = q.shape
        n_text, length = k.shape[2], self.tokens[encoder]
        if n_image != grid[0] * grid[1]:
            raise ShapingError(f"an attention call has {n_image} image tokens for a grid of {grid[0]}×{grid[1]}")
        if n_text % length:
            raise PromptLengthError.of(n_text, length, encoder)
        copies = n_text // length
        index = [torch.tensor([p + j * length for j in range(copies) for p in s.words[encoder]], device=q.device)
                 for s in self.subjects]
        maps = torch.zeros(len(self.subjects), items, n_image, device=q.device)
        for h in range(heads):  # one head's weights at a time: [items, image tokens, text tokens]
            w = (q[:, h].float() @ k[:, h].float().transpose(-1, -2) * scale).softmax(-1)
            for i, ix in enumerate(index):
                maps[i] += w.index_select(-1, ix).sum(-1) / len(self.subjects[i].words[encoder])
        maps = (maps / heads).reshape(len(self.subjects) * items, 1, *grid)
        maps = F.interpolate(maps, size=latent, mode="bilinear", align_corners=False)
        maps = maps.reshape(len(self.subjects), items, *latent).cpu()
        if self.sums is not None and self.sums.shape != maps.shape:
            raise ShapingError(f"attention maps of {tuple(maps.shape[1:])} (items, height, width) after maps of "
                               f"{tuple(self.sums.shape[1:])} in one sampling")
        self.sums = maps if self.sums is None else self.sums + maps
        self.calls += 1

    def find(self) -> torch.Tensor:
        """The regions from what was recorded, kept in `found`: [subjects, items, h, w] of 0 and 1
        (`NothingRecordedError` where nothing was)."""
        if self.sums is None:
            raise NothingRecordedError.of()
        m = self.sums
        if self.smooth > 0:
            m = blur(m.reshape(-1, 1, *m.shape[-2:]), self.smooth).reshape(m.shape)
        m = m / m.amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)
        best, winner = m.max(0)
        taken = best > self.threshold
        found = torch.stack([(winner == i) & taken for i in range(len(self.subjects))]).float()
        if self.background == "at strength":
            found = torch.maximum(found, (~taken).float().expand_as(found))
        self.found = found
        return found

    def regions(self) -> list[Region]:
        """The found regions, one per subject (`find` first)."""
        return [Region.of(m, 0.0, self.text, name=s.name) for s, m in zip(self.subjects, self.found)]
