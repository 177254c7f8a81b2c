"""The strengths of one bank's slots, and what its layers share of it.

`Strengths` holds the table an activation's request fills (`request.Request`), [N] or [batch, N] on the host, and
the scale the layers read, the same on the compute device: the table (or `set_items`' per-item table, a
conditioning's) times each slot's schedule at the current progress. It also holds each layer's own factors (layer
weights) and the live mask: which slots a layer computes, those whose strength (times its factor) is not 0 for some
item. `Owner` is what the layers and writes read and count of their bank: its settings, counters and two callbacks,
never the bank itself.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from .adapter import Adapter
from .errors import LoRAShapeError, NonFiniteError, ShapingError
from .regions import Masks, Region
from .request import LayerWeights, Request, Strength, check_sizes, snapshot, strength_table
from .schedule import Schedule


def module_weight(module: nn.Module) -> torch.Tensor:
    return module.weight.detach()


class Owner:
    """What a bank's strength table, layers and writes read and count of the bank, without holding it: the model's
    name, the slots' dtype, device and least rank, how a layer's weight is read; the buffers reallocated and the
    hooks made (torch.compile does not guard on hooks: a host that compiles the model recompiles when
    `hooks_made` grows); and two calls a forward hook makes: `release_when_idle`, a host's release for a bank that
    no stack will use again (called by the first forward that runs while the bank is inactive, never while a stack
    is active; cleared by an activation), and `follow`, which moves the bank to the device an input arrives on."""

    def __init__(self, model_name: str, dtype: torch.dtype, device: torch.device, slot_rank: int = 0,
                 weight_fn: Callable[[nn.Module], torch.Tensor] | None = None,
                 move: Callable[[torch.device], None] | None = None):
        self.model_name, self.dtype, self.device, self.slot_rank = model_name, dtype, device, slot_rank
        self.weight_fn = weight_fn or module_weight
        self.reallocations = 0
        self.hooks_made = 0
        self.release_when_idle: Callable[[], None] | None = None
        # weak: the bank holds its layers, whose hooks the model holds (`SlotBank.root`)
        self._move = None if move is None else weakref.WeakMethod(move)

    def follow(self, device: torch.device) -> None:
        """Move the bank to `device`, where an input arrives on another device than its slots."""
        move = self._move() if self._move is not None else None
        if move is not None:
            move(device)


class Columns(Protocol):
    """A layer's low-rank rows (`layer.Rows`) as the table expands strengths to them."""

    key: tuple

    def columns(self, scale: torch.Tensor) -> torch.Tensor: ...


class Strengths:
    """The strength table of one bank's `n` slots, its scale on the device, the layers' factors and the live mask.
    `generation` counts changes of the scale and the live slots (a layer's cached scale follows it); `live_changed`
    says that the layers' live slots are to be found again (`live_of`), which the bank tells them."""

    def __init__(self, n: int, owner: Owner):
        self.owner = owner
        self.n = n
        self.active = False  # a stack is active: the hooks apply the scale, else they do nothing
        # The batch of the model call under way, where the host says it (None: unknown): a layer whose input has
        # other rows than that mixes the call's items, and per-item strengths are refused there (`LayerSlots`).
        self.call_rows: int | None = None
        self.progress, self.steps = 0.0, None
        self.generation = 0
        self.all_zero = True
        self.schedules: dict[int, Schedule | tuple[Schedule | None, ...]] = {}
        self._scale_n = torch.zeros(n, dtype=owner.dtype, device=owner.device)
        self._scale_items: torch.Tensor | None = None
        self.scale = self._scale_n  # [N] or [batch, N] on the device
        self._table = torch.zeros(n)  # unscheduled strengths on the host, [N] or [batch, N]
        self.requested: dict[int, Strength] = {}  # each held slot's strength as its activation gave it
        self._call_table: torch.Tensor | None = None  # `set_items`: [batch, N], in place of the table until reset
        self._items: dict[int, list[float]] | None = None  # `set_items`' rows by slot (NaN: the slot's own)
        self._seen: torch.Tensor | None = None  # [N]: each slot's largest |strength| since `set_items` began
        self._columns: dict[tuple, torch.Tensor] = {}  # Rows.key -> the scale expanded to its columns
        self.weights: tuple | None = None  # the layer weights (and batch) the factors were made for
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its factor (host, device)
        self._live_key: bytes | None = None  # the zero pattern the live slots were found for
        self._live: torch.Tensor | None = None  # the strengths they were found from, [N] or [batch, N]
        self._live_shared: list[bool] = [False] * n
        self.live_changed = False
        self.masks = Masks(n, owner.dtype, owner.device)  # the slots' regions and their per-token factors
        self.assigned: dict[int, Region] = {}  # the regions the activation gave, by slot (`set_found` adds others)

    # -- what the layers read ----------------------------------------------------------------------------------

    def column_scale(self, rows: Columns) -> torch.Tensor:
        """The scale expanded to a layer's low-rank columns, [Σr] or [batch, Σr]: computed once per pattern of slots
        and ranks per strength change, and shared by every layer with that pattern."""
        cols = self._columns.get(rows.key)
        if cols is None:
            cols = self._columns[rows.key] = rows.columns(self.scale)
        return cols

    def factor_of(self, layer: str) -> torch.Tensor | None:
        """The layer's factors on the device, [N] or [batch, N]; None: all 1."""
        factor = self.factors.get(layer)
        return None if factor is None else factor[1]

    def live_of(self, layer: str) -> list[bool]:
        """Which slots the layer computes, by slot: its strength times the layer's factor is not 0 for some item."""
        factor = self.factors.get(layer)
        if factor is None:
            return self._live_shared
        own = (self._live * factor[0]) != 0
        return (own.any(0) if own.dim() == 2 else own).tolist()

    @property
    def per_item(self) -> bool:
        """The strengths, a schedule or layer weights are one per batch item (a strength grid's activation)."""
        weights = self.weights[0] if self.weights is not None else {}
        return self._table.dim() == 2 or any(isinstance(v, tuple) for v in
                                             (*self.schedules.values(), *weights.values()))

    # -- changes -------------------------------------------------------------------------------------------------

    def assign(self, request: Request, slots: list[int], layers: Iterable[str], new_layers: bool) -> None:
        """The strengths, schedules and layer weights of `request`, its entry j in slot `slots[j]`; the factors are
        made again where the weights changed or `new_layers` (a newcomer may have brought layers)."""
        entries, batch, table = request.entries, request.batch, request.table
        self.schedules = {slots[j]: e.schedule for j, e in enumerate(entries) if e.schedule is not None}
        self.assigned = {slots[j]: e.region for j, e in enumerate(entries) if e.region is not None}
        if self.masks.set_regions(self.assigned, self.n):
            self.invalidate_live()  # the layers' masked slots change
        weights = {slots[j]: snapshot(e.layer_weights) for j, e in enumerate(entries) if e.layer_weights is not None}
        key = (weights, batch if weights else None)
        if new_layers or key != self.weights:
            self.set_layer_weights(weights, batch, layers)
            self.weights = key
        self._table = self._filled({slots[j]: table[:, j] if batch is not None else table[j]
                                    for j in range(len(entries))}, batch)
        self._call_table = self._seen = self._items = None
        self.progress, self.steps = 0.0, None
        self.requested = {slots[j]: e.strength for j, e in enumerate(entries)}
        self.push()

    def set_found(self, regions: Mapping[int, Region]) -> None:
        """See `SlotBank.set_found`; `regions` by slot."""
        if self.masks.set_regions({**self.assigned, **regions}, self.n):
            self.invalidate_live()
            self.push()

    def set_progress(self, progress: float, steps: int | None = None) -> None:
        """See `SlotBank.set_progress`."""
        if not self.schedules or (progress, steps) == (self.progress, self.steps):
            self.progress, self.steps = progress, steps
            return
        self.progress, self.steps = progress, steps
        self.push()

    def set_items(self, rows: Mapping[Adapter, Sequence[float | None]] | None,
                  slot_of: Callable[[Adapter], int]) -> None:
        """See `SlotBank.set_items`; `slot_of` gives a resident adapter's slot."""
        if rows is None:
            self._items = None
            if self._call_table is not None:
                self._call_table = None
                self.push()  # the slots live in the tables set stay live: the next call may set them again
            return
        if self.per_item:
            raise ShapingError("this model's LoRAs already have per-item strengths (a strength grid); "
                               "per-item strengths of another source cannot be set on top of them",
                               remedy="sample the grid without them, or them without the grid")
        given = [float(v) for values in rows.values() for v in values if v is not None]
        if not all(math.isfinite(v) for v in given):
            raise NonFiniteError("a per-item strength is NaN or Inf", remedy="use finite strengths")
        columns = {slot_of(a): [math.nan if v is None else float(v) for v in values] for a, values in rows.items()}
        batch = {len(v) for v in columns.values()}
        if len(batch) != 1 or 0 in batch:
            raise LoRAShapeError(f"per-item strengths of different lengths ({sorted(batch)})")
        self._items = columns
        table = self._items_table()
        if self._call_table is not None and torch.equal(table, self._call_table):
            return
        if self._seen is None:
            self._seen = self._table.abs()
        self._call_table = table
        self.push()

    def set_strength(self, slot: int, value: Strength, names: Mapping[int, str], layers: Iterable[str],
                     path: str | None = None) -> None:
        """See `SlotBank.set_strength`; `names`: the adapter name of each held slot, `path` the file of `slot`'s."""
        requested = {**self.requested, slot: value}
        held = sorted(requested)
        strengths = strength_table([requested[s] for s in held])
        batch = strengths.shape[0] if strengths.dim() == 2 else None
        weights = self.weights[0] if self.weights is not None else {}
        check_sizes(batch, ((names[s], self.schedules.get(s), weights.get(s)) for s in held))
        if batch is not None and self._items is not None:
            raise ShapingError("per-item strengths cannot be set while set_items' are", path=path,
                               remedy="call set_items(None) first")
        self.requested = requested
        if weights and self.weights[1] != batch:
            self.weights = (weights, batch)
            self.set_layer_weights(weights, batch, layers)
        self._table = self._filled({s: strengths[..., j] for j, s in enumerate(held)}, batch)
        if self._items is not None:
            self._call_table = self._items_table()
        self.push()

    def zero(self, slots: Iterable[int]) -> None:
        """These slots at strength 0, as requested too; `set_items`' tables are dropped."""
        table = self._table.clone()
        for i in slots:
            table[..., i] = 0.0
            self.requested[i] = 0.0
        self._table = table
        self._call_table = self._seen = self._items = None
        self.invalidate_live()
        self.push()

    def grow(self, n: int, layers: Iterable[str]) -> None:
        """`n` slots: the new ones at 0; the per-item tables and the scale are made again."""
        extra = n - self.n
        self.n = n
        self.masks.set_regions(self.masks.regions, n)
        self._table = torch.cat([self._table, self._table.new_zeros(*self._table.shape[:-1], extra)], -1)
        self._scale_n = torch.zeros(n, dtype=self.owner.dtype, device=self.owner.device)
        self._scale_items = None
        self._call_table = self._seen = self._items = None
        if self.weights is not None:
            self.set_layer_weights(*self.weights, layers)
        self.invalidate_live()
        self.push()

    def clear(self) -> None:
        """No slot held (a released bank)."""
        self.requested, self._items, self.assigned = {}, None, {}
        self.masks.set_regions({}, self.n)
        self.weights = None
        self.factors = {}
        self.invalidate_live()
        self.active = False

    def to(self, device: torch.device) -> None:
        self._scale_n = self._scale_n.to(device)
        if self._scale_items is not None:
            self._scale_items = self._scale_items.to(device)
        self.scale = self.scale.to(device)
        self.factors = {k: (host, dev.to(device)) for k, (host, dev) in self.factors.items()}
        self.masks.to(device)
        self._columns = {}
        self.generation += 1

    def invalidate_live(self) -> None:
        """The layers' live slots are to be found again at the next change (slots or layers changed)."""
        self._live_key = None

    def set_layer_weights(self, weights: dict[int, LayerWeights | tuple], batch: int | None,
                          layers: Iterable[str]) -> None:
        """Per-layer factors for the slots that have layer weights; every other layer and slot has 1."""
        items = max((len(w) for w in weights.values() if isinstance(w, tuple)), default=None)
        rows = items or batch
        factors = {}
        for name in layers:
            factor = None
            for slot, w in weights.items():
                per_item = w if isinstance(w, tuple) else None
                values = [1.0 if m is None else m.get(name, 1.0) for m in per_item] if per_item else \
                    [w.get(name, 1.0)]
                if all(v == 1.0 for v in values):
                    continue
                if factor is None:
                    factor = torch.ones((self.n,) if rows is None else (rows, self.n))
                factor[..., slot] = torch.tensor(values) if per_item else values[0]
            if factor is not None:
                factors[name] = (factor, factor.to(device=self.owner.device, dtype=self.owner.dtype))
        self.factors = factors
        self.invalidate_live()

    # -- internals -------------------------------------------------------------------------------------------------

    def _items_table(self) -> torch.Tensor:
        """`set_items`' table: its rows over the activation's strengths."""
        batch = len(next(iter(self._items.values())))
        table = self._table.expand(batch, self.n).clone()
        for slot, values in self._items.items():
            v = torch.tensor(values)
            table[:, slot] = torch.where(v.isnan(), table[:, slot], v)
        return table

    def _filled(self, table: dict[int, torch.Tensor], batch: int | None) -> torch.Tensor:
        """The strengths table [N] or [batch, N]: `table`'s slots set, the others 0."""
        values = torch.zeros((self.n,) if batch is None else (batch, self.n), dtype=torch.float32)
        for i, v in table.items():
            values[..., i] = v
        return values

    def _multipliers(self) -> torch.Tensor | None:
        """The schedules' multipliers at the current progress, [N] or [batch, N]; None without schedules."""
        if not self.schedules:
            return None
        batch = max((len(s) for s in self.schedules.values() if isinstance(s, tuple)), default=None)
        mult = torch.ones((self.n,) if batch is None else (batch, self.n))
        p = self.progress
        for slot, sched in self.schedules.items():
            if isinstance(sched, tuple):
                mult[:, slot] = torch.tensor([1.0 if s is None else s.at(p, self.steps) for s in sched])
            else:
                mult[..., slot] = sched.at(p, self.steps)
        return mult

    def push(self) -> None:
        """Write the strengths (`set_items`' where set) times the schedules' multipliers into the device scale, and
        find the live slots again where their zero pattern changed (`live_changed`)."""
        values = self._table if self._call_table is None else self._call_table
        mult = self._multipliers()
        if mult is not None:
            values = values * mult
        if values.dim() == 1:
            self._scale_n.copy_(values)
            self.scale = self._scale_n
        else:
            if self._scale_items is None or self._scale_items.shape != values.shape:
                self._scale_items = torch.empty(values.shape, dtype=self.owner.dtype, device=self.owner.device)
            self._scale_items.copy_(values)
            self.scale = self._scale_items
        self.all_zero = not bool(values.any())
        self._columns = {}
        self.generation += 1
        if self._seen is not None:  # `set_items`' tables: the slots live in any of them stay live
            self._seen = torch.maximum(self._seen, values.abs().amax(0) if values.dim() == 2 else values.abs())
            values = self._seen
        nonzero = values != 0
        key = bytes(nonzero.reshape(-1).tolist()) + bytes(nonzero.shape)
        if key != self._live_key:
            self._live_key, self._live = key, values
            self._live_shared = (nonzero.any(0) if nonzero.dim() == 2 else nonzero).tolist()
            self.live_changed = True
