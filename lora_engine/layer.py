"""One layer's slot buffers, the rows it computes, and its forward hook.

A targeted layer holds A [N·R, in, *k] and B [out, N·R] for the N slots of its
bank, R padded to the layer's slot rank, plus a dense delta or a bias per slot
for adapters that cannot run in low rank. Slot i owns rows i·R … (i+1)·R − 1
of A and those columns of B; a Linear's B is column-major, so that each slot's
columns are one dense block (`_new_b`).

Each layer computes only its live slots: those it holds whose strength (times
its factor) is not 0 for some batch item. Trailing dead slots are cut from the
GEMMs, dead dense slots are skipped, and a layer with none live returns at once;
warm slots at strength 0 cost nothing per step. Where dead slots between live
ones or the padding of lower-rank adapters would leave a quarter or more of the
rows empty, the layer keeps a packed copy of the live rows (`Rows`). Under
torch.compile every slot is computed instead, from the fixed buffers (a free
slot is zero), and the dense and bias slots from a list in slot order with
their slots in a tensor (`stack`), so that neither a strength change nor a
change of the slots in use recompiles the graph; only a change in how many
dense or bias slots a layer holds does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from . import runtime
from .errors import MixedItemsError
from .plan import Geometry, ModulePlan
from .strengths import Owner, Strengths


# Every layer whose forward hook is on its module, until `unhook`: weakly, so a layer and its module go together.
_HOOKED: weakref.WeakSet[LayerSlots] = weakref.WeakSet()


def hooked_layers() -> int:
    """How many layers have their forward hook on a live module. A bank's release removes its layers' hooks, so a
    count above the layers the banks hold is a hook left behind."""
    return len(_HOOKED)


class LayerSlots:
    """One layer's buffers and its forward hook. It reads its bank's strength table (`strengths.Strengths`) and
    what it shares of the bank (`strengths.Owner`), never the bank."""

    def __init__(self, table: Strengths, name: str, module: nn.Module):
        self.table = table
        self.owner: Owner = table.owner
        self.name = name
        self.geometry = Geometry.of(module)
        self.n = table.n
        self.dtype = self.owner.dtype
        self.rank = 0
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # each slot's rows (`slot`)
        self.lr_used: set[int] = set()
        self.dirty: set[int] = set()  # slots no adapter holds whose rows may not be zero yet (see `scrub`)
        self.dense: dict[int, torch.Tensor | runtime.Kron] = {}  # ΔW, or a LoKr's factors (`runtime.Kron`)
        self.bias: dict[int, torch.Tensor] = {}
        self.stacked: tuple = NOTHING_STACKED  # the dense and bias slots as the compiled path reads them (`stack`)
        self.factor: torch.Tensor | None = None  # [N] or [batch, N] layer weights as the table holds them; None: all 1
        self.cached_scale: _Scale | None = None
        self.rows: Rows | None = None  # the low-rank rows computed at each step (None: no live low-rank slot)
        self.ranks: dict[int, int] = {}  # low-rank slot -> the rows its adapter fills (the rest is padding)
        self.dead: set[int] = set()  # dense or bias slots whose strength is 0
        self.idle = True  # no live slot at all
        self.masked = False  # a live slot has a mask (`regions`): the rows take a factor per token
        self.handle = module.register_forward_hook(self._hook, with_kwargs=True)
        _HOOKED.add(self)

    def unhook(self) -> None:
        """Remove the layer's forward hook from its module."""
        self.handle.remove()
        _HOOKED.discard(self)

    @property
    def hi(self) -> int:
        """The low-rank slots 0..hi-1 hold every live one: hi - 1 is the last live slot (0: none)."""
        return 0 if self.rows is None else self.rows.key[-1][0] + 1

    @property
    def empty(self) -> bool:
        """No adapter holds a slot of this layer."""
        return not (self.lr_used or self.dense or self.bias)

    def nbytes(self) -> int:
        packed = (self.rows.a, self.rows.b) if self.rows is not None and self.rows.packed else ()
        ts = [self.a, self.b, *packed, *self.bias.values()]
        dense = sum(d.nbytes() if isinstance(d, runtime.Kron) else d.numel() * d.element_size()
                    for d in self.dense.values())
        return dense + sum(t.numel() * t.element_size() for t in ts if t is not None)

    def _hook(self, module, args, kwargs, out):
        table = self.table
        compiling = torch.compiler.is_compiling()
        # Under torch.compile the layer is skipped only when it has no buffers at all (see `_compiled`).
        skip = (self.a is None and self.stacked is NOTHING_STACKED) if compiling else (table.all_zero or self.idle)
        if not table.active:
            release = self.owner.release_when_idle
            if release is not None and not compiling:
                release()  # the model runs without the stack that no one carries any more
            return None
        if skip:
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        if table.scale.dim() == 2 and table.call_rows is not None and x.shape[0] != table.call_rows:
            self._mixed_items(x.shape[0])
        if x.device != self.owner.device:
            self.owner.follow(x.device)
        if compiling:
            return self._compiled(module, x, out)
        rows = self.rows
        if self.factor is None:
            scale = table.scale
            columns = None if rows is None else table.column_scale(rows)
        else:
            scale, columns = self.weighted_scale()
        tokens = self._tokens(x, out) if self.masked else None
        if rows is None:
            return runtime.apply(self, module, x, out, scale, dead=self.dead, tokens=tokens)
        return runtime.apply(self, module, x, out, scale, rows.a, rows.b, columns, self.dead, tokens=tokens)

    def _tokens(self, x, out) -> torch.Tensor:
        """The masked slots' factor per token for this input (`regions.Masks.factor`). An input whose rows are not
        the model call's items (a mixture of experts' tokens gathered over the batch) is refused unless the host
        says where each row came from."""
        masks = self.table.masks
        factor = masks.factor_outside_graph if torch.compiler.is_compiling() else masks.factor
        return factor(self.name, self.owner.model_name, self.geometry, x, out, self.table.call_rows)

    def _mixed_items(self, rows: int) -> None:
        """Per-item strengths are taken row by row from an input's first axis, which a layer such as a mixture of
        experts' (HiDream's, which routes tokens flattened over the batch) or a pooler that puts the sequence first
        does not lay out by item: refused, where strengths would otherwise go to other items' tokens."""
        raise MixedItemsError(f"layer {self.name!r} of {self.owner.model_name} takes an input of {rows} rows in a "
                              f"model call of {self.table.call_rows} items: it mixes the items of the batch, so "
                              "per-item LoRA strengths cannot reach it",
                              remedy="give this layer a block weight of 0 in the LoRAs that reach it, or use one "
                                     "strength for every item")

    def _compiled(self, module, x, out):
        """The hook's work under torch.compile: every slot, from the fixed buffers, whatever the strengths and
        whichever slots are held (a slot no adapter holds is zero). The graph's guards then see the buffers'
        shapes, not which strengths are 0 or which slots are in use, so that no slider move, swap, release or
        newcomer of a rank the slots hold recompiles it; nor does it read the eager path's caches, whose checks
        would be guarded too."""
        scale = self.table.scale if self.factor is None else self.table.scale * self.factor
        tokens = self._tokens(x, out) if self.table.masks.regions else None
        if self.a is None:
            return runtime.apply(self, module, x, out, scale, stacked=self.stacked, tokens=tokens)
        return runtime.apply(self, module, x, out, scale, self.a, self.b, scale.repeat_interleave(self.rank, -1),
                             stacked=self.stacked, tokens=tokens)

    def weighted_scale(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The strengths times this layer's weights, and those expanded to its rows' columns: computed at the
        first step after a strength change, not at every step."""
        gen = self.table.generation
        if self.cached_scale is None or self.cached_scale.generation != gen:
            scale = self.table.scale * self.factor
            self.cached_scale = _Scale(gen, scale, None if self.rows is None else self.rows.columns(scale))
        return self.cached_scale.scale, self.cached_scale.columns

    def set_live(self, table: Strengths) -> None:
        """Which slots to compute, and this layer's factors, as the table has them: a slot is live where its
        strength (times the factor) is not 0 for some item."""
        live = table.live_of(self.name)
        self.factor = table.factor_of(self.name)
        lr = sorted(s for s in self.lr_used if live[s])
        extra = set(self.dense) | set(self.bias)
        self.dead = {s for s in extra if not live[s]}
        self.idle = not lr and not (extra - self.dead)
        self.masked = any(s in table.masks.regions for s in (*lr, *(extra - self.dead)))
        self.rows = Rows.of(self, lr, packable=not self.masked)

    def stack(self, device: torch.device | None = None) -> None:
        """The dense and bias slots as the compiled path reads them: (deltas, their slots, biases, their slots), the
        tensors in slot order and the slots as device tensors, so that its graph depends on how many there are,
        not on which slots hold them. Made by the bank after adapters enter or leave slots, outside any compiled
        region, and on `device` (default: the bank's) when the layer moves; a strength change leaves it as it is."""
        if not self.dense and not self.bias:
            self.stacked = NOTHING_STACKED
            return
        dev = device or self.owner.device
        dense, bias = sorted(self.dense.items()), sorted(self.bias.items())
        self.stacked = (tuple(t for _, t in dense), torch.tensor([s for s, _ in dense], device=dev),
                        tuple(t for _, t in bias), torch.tensor([s for s, _ in bias], device=dev))

    def ensure_rank(self, rank: int) -> None:
        """Slot buffers of at least `rank` rows per slot. The first ones are left unfilled, every slot dirty:
        the activation writes or scrubs each of them before the next forward."""
        if rank <= self.rank:
            return
        g, dev = self.geometry, self.owner.device
        first = self.a is None
        new = _unfilled if first else torch.zeros
        a = new((self.n * rank, g.in_features, *g.kernel), dtype=self.dtype, device=dev)
        b = self._new_b(new, self.n * rank, dev)
        if not first:
            for i in self.lr_used:
                a[i * rank:i * rank + self.rank] = self.a[i * self.rank:(i + 1) * self.rank]
                b[:, i * rank:i * rank + self.rank] = self.b[:, i * self.rank:(i + 1) * self.rank]
        self.dirty = set(range(self.n)) - self.lr_used if first else set()
        self.rank = rank
        self._buffers(a, b)
        self.owner.reallocations += 1

    def resize(self, n: int) -> None:
        """`n` slots of the current rank. More slots reallocate the buffers: the current ones are copied into
        their first rows, on the device, and the new slots are zero. Fewer (undoing a growth) keep a view of the
        first n slots and allocate nothing."""
        if self.a is not None:
            rows, held = n * self.rank, self.a.shape[0]
            if rows <= held:
                self._buffers(self.a[:rows], self.b[:, :rows])
            else:
                a = torch.empty((rows, *self.a.shape[1:]), dtype=self.dtype, device=self.a.device)
                b = self._new_b(torch.empty, rows, self.b.device)
                a[:held].copy_(self.a)
                a[held:].zero_()
                b[:, :held].copy_(self.b)
                b[:, held:].zero_()
                self._buffers(a, b)
                self.owner.reallocations += 1
            if self.rows is not None:
                self.rows = self.rows.to(self)  # its views would keep the old buffers alive
        self.n = n

    def _new_b(self, make, columns: int, device: torch.device) -> torch.Tensor:
        """B [out, columns] from `make` (`torch.empty`, `torch.zeros`): a Linear's column-major (the transpose of
        a [columns, out] buffer), so that each slot's columns are one dense block, which an adapter's column-major
        B (`adapter._column_major`) fills in one contiguous copy and which zeroes at once; a conv's row-major, the 1×1
        conv weight it is used as."""
        out = self.geometry.out_features
        if self.geometry.conv_dims:
            return make((out, columns), dtype=self.dtype, device=device)
        return make((columns, out), dtype=self.dtype, device=device).t()

    def columns_of_b(self, index: torch.Tensor) -> torch.Tensor:
        """A copy of B's columns `index`, laid out as B is (`_new_b`): a layer computes the same from a packed copy
        of its rows as from its slot buffers (a GEMM's rounding may depend on its operands' layout)."""
        if self.b.stride(0) == 1:  # column-major
            return self.b.t().index_select(0, index).t()
        return self.b.index_select(1, index)

    def prepare(self, slot: int, plan: ModulePlan) -> None:
        """Before `plan` is written into a slot: zero the slot unless it is clean already or the write fills
        every row."""
        if slot in self.dirty:
            if plan.full_rank != self.rank:
                self._zero(slot)
            self.dirty.discard(slot)

    def scrub(self) -> None:
        """Zero the dirty slots: a slot no adapter holds is zero whenever the layer runs."""
        for slot in self.dirty:
            self._zero(slot)
        self.dirty.clear()

    def _zero(self, slot: int) -> None:
        a, b = self.slot(slot)
        a.zero_()
        b.zero_()

    def slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s rows of A [R, in, *k] and columns of B [out, R]: views, sliced once per buffer."""
        if self.views is None:
            self.views = [None] * self.n
        views = self.views[slot]
        if views is None:
            r = self.rank
            views = self.views[slot] = (self.a.narrow(0, slot * r, r), self.b.narrow(1, slot * r, r))
        return views

    def _buffers(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b, self.views = a, b, None

    def clear(self, slot: int) -> None:
        """Free the slot; its rows are zeroed by `scrub`, unless a newcomer overwrites them first."""
        self.ranks.pop(slot, None)
        if slot in self.lr_used:
            self.lr_used.discard(slot)
            self.dirty.add(slot)
        self.dense.pop(slot, None)
        self.bias.pop(slot, None)

    def to(self, device: torch.device) -> None:
        if self.a is not None:
            self._buffers(self.a.to(device), self.b.to(device))
        self.dense = {k: v.to(device) for k, v in self.dense.items()}
        self.bias = {k: v.to(device) for k, v in self.bias.items()}
        self.stack(device)
        self.factor = self.table.factor_of(self.name)  # moved with the table
        self.cached_scale = None
        self.rows = None if self.rows is None else self.rows.to(self)


@dataclass(frozen=True)
class Rows:
    """The low-rank rows a layer computes at each step: A [Σr, in, *k], B [out, Σr], and `key`, the (slot, rows)
    of each slot they hold, in order. Either views of the slot buffers' first hi slots, padding and dead slots
    included, or, when those would leave a quarter or more of their rows empty, a packed copy of the live slots'
    filled rows alone (`packed`). The strengths are expanded to the Σr columns once per change
    (`Strengths.column_scale`), so a step scales them in one operation."""

    key: tuple[tuple[int, int], ...]
    a: torch.Tensor
    b: torch.Tensor
    packed: bool
    slot_of: torch.Tensor | None = None  # packed: [Σr] long, the slot of each column

    SAVING = 0.75  # pack when the live rows are at most this share of the rows the slot buffers compute

    @classmethod
    def of(cls, layer: LayerSlots, live: list[int], packable: bool = True) -> Rows | None:
        """The rows of the `live` slots; views of the buffers where `packable` is False (a masked layer scales
        each slot's R columns at once, `runtime`)."""
        if not live:
            return None
        rank, dev, hi = layer.rank, layer.a.device, live[-1] + 1
        key = tuple((s, layer.ranks.get(s, rank)) for s in live)
        if not packable or sum(r for _, r in key) > cls.SAVING * hi * rank:
            return cls(tuple((s, rank) for s in range(hi)), layer.a[:hi * rank], layer.b[:, :hi * rank], False)
        index = torch.cat([torch.arange(s * rank, s * rank + r) for s, r in key]).to(dev)
        slot_of = torch.cat([torch.full((r,), s, dtype=torch.long) for s, r in key]).to(dev)
        return cls(key, layer.a.index_select(0, index), layer.columns_of_b(index), True, slot_of)

    def columns(self, scale: torch.Tensor) -> torch.Tensor:
        """The strengths, [N] or [batch, N], expanded to these rows' columns."""
        if self.slot_of is not None:
            return scale.index_select(-1, self.slot_of)
        return scale[..., :len(self.key)].repeat_interleave(self.key[0][1], -1)

    def to(self, layer: LayerSlots) -> Rows:
        """The same rows on `layer`'s current buffers, after they moved to another device or grew."""
        if not self.packed:
            n = len(self.key) * layer.rank
            return Rows(self.key, layer.a[:n], layer.b[:, :n], False)
        dev = layer.a.device
        return Rows(self.key, self.a.to(dev), self.b.to(dev), True, self.slot_of.to(dev))


class _Scale(NamedTuple):
    """A layer's strengths for one `Strengths.generation`: the scale times the layer's factor, and that expanded to its
    rows' columns (None without rows)."""

    generation: int
    scale: torch.Tensor
    columns: torch.Tensor | None


NOTHING_STACKED = ((), None, (), None)
_unfilled = torch.empty  # first slot buffers: every row is written or scrubbed before a forward reads it
