"""What one activation asks of a bank: its entries, merged one per adapter and checked once.

An entry is an adapter with its strength (a number, or one per batch item) and what shapes it: a schedule over the
sampling progress, layer weights, a mask (`regions.Region`). `Request` merges the entries, one per adapter, and
checks them once where a stack enters the engine: every strength finite, per-item values of one batch size. Its
`table` holds the strengths, [n] or [batch, n], which `strengths.Strengths` puts in the bank's slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .adapter import Adapter
from .errors import LoRAShapeError, NonFiniteError, ShapingError
from .regions import Region
from .schedule import Product, Schedule, Switch

Strength = float | Sequence[float] | torch.Tensor
LayerWeights = Mapping[str, float]  # layer name -> multiplier; a layer left out has 1


@dataclass(frozen=True)
class Entry:
    """One adapter of an activation. `schedule` and `layer_weights` may be one per batch item (a tuple); `region`
    is a mask that gives it a strength per token (`regions`)."""

    adapter: Adapter
    strength: Strength
    schedule: Schedule | Switch | Product | tuple[Schedule | Switch | Product | None, ...] | None = None
    layer_weights: LayerWeights | tuple[LayerWeights | None, ...] | None = None
    region: Region | None = None

    @property
    def shaped(self) -> bool:
        return self.schedule is not None or self.layer_weights is not None or self.region is not None


@dataclass(frozen=True)
class Request:
    """The entries of one activation, merged one per adapter (`merge`) and checked: `table` holds their strengths,
    [n] when each is one number, else [batch, n]. Made where a stack enters the engine; an activation given a
    request checks nothing again."""

    entries: tuple[Entry, ...]
    table: torch.Tensor

    @classmethod
    def of(cls, entries: Request | Iterable[Entry | tuple[Adapter, Strength]]) -> Request:
        """`entries` merged and checked (a `Request` as it is): a `ShapingError` for a shaped adapter listed twice
        or per-item values of different lengths, a `NonFiniteError` for a NaN or Inf strength."""
        if isinstance(entries, Request):
            return entries
        merged = tuple(merge(entries).values())
        table = strength_table([e.strength for e in merged])
        request = cls(merged, table)
        check_sizes(request.batch, ((e.adapter.name, e.schedule, e.layer_weights) for e in merged))
        return request

    @property
    def batch(self) -> int | None:
        """The items of per-item strengths; None where each strength is one number."""
        return self.table.shape[0] if self.table.dim() == 2 else None


def merge(entries: Iterable[Entry | tuple[Adapter, Strength]]) -> dict[int, Entry]:
    """The entries of one activation, one per adapter (by id): an adapter listed more than once gets the sum of
    its strengths, and is refused when one of its entries has a schedule or layer weights (a `ShapingError`)."""
    merged: dict[int, Entry] = {}
    for item in entries:
        e = item if isinstance(item, Entry) else Entry(*item)
        prev = merged.get(id(e.adapter))
        if prev is not None and (prev.shaped or e.shaped):
            raise ShapingError(f"{e.adapter.name} appears twice in the stack and one entry has a schedule, "
                               "block weights or a mask", path=e.adapter.path, remedy="keep one entry for this LoRA")
        merged[id(e.adapter)] = e if prev is None else Entry(e.adapter, _add_strength(prev.strength, e.strength))
    return merged


def _add_strength(a: Strength, b: Strength) -> torch.Tensor:
    return torch.as_tensor(a, dtype=torch.float32) + torch.as_tensor(b, dtype=torch.float32)


def snapshot(weights: LayerWeights | tuple[LayerWeights | None, ...]) -> dict | tuple:
    """A copy of an entry's layer weights, so that a caller's mapping edited in place and activated again is seen
    as new weights."""
    if isinstance(weights, tuple):
        return tuple(None if w is None else dict(w) for w in weights)
    return dict(weights)


def check_sizes(batch: int | None, shaping: Iterable[tuple[str, object, object]]) -> None:
    """`batch` per-item strengths (None: one strength) and the (adapter name, schedule, layer weights) of each
    adapter must all have one batch size where they are per item."""
    sizes = {} if batch is None else {batch: "per-item strengths"}
    for name, schedule, weights in shaping:
        for what, v in (("schedules", schedule), ("block weights", weights)):
            if isinstance(v, tuple):
                sizes.setdefault(len(v), f"{name}'s per-item {what}")
    if len(sizes) > 1:
        raise ShapingError("per-item values of different lengths: " +
                           ", ".join(f"{n} {what}" for n, what in sizes.items()))


def strength_table(values: list[Strength]) -> torch.Tensor:
    """[N] when every strength is a number, else [batch, N]."""
    ts = [torch.as_tensor(v, dtype=torch.float32).detach().cpu().reshape(-1) for v in values]
    if not all(bool(torch.isfinite(t).all()) for t in ts):
        raise NonFiniteError("a strength is NaN or Inf", remedy="use finite strengths")
    if all(t.numel() == 1 for t in ts):
        return torch.stack([t[0] for t in ts]) if ts else torch.zeros(0)
    batch = max(t.numel() for t in ts)
    for t in ts:
        if t.numel() not in (1, batch):
            raise LoRAShapeError(f"per-item strengths of different lengths ({t.numel()} and {batch})")
    return torch.stack([t.expand(batch) if t.numel() == 1 else t for t in ts], dim=1)
