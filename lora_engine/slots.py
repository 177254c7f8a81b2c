"""Per-model slots and the activation rules.

A `SlotBank` owns `max_loras` slots on one root module. Each targeted layer
holds A [N·R, in, *k] and B [out, N·R] on the compute device, R padded to the
layer's slot rank, so shapes stay fixed while adapters and strengths change
(`layer.LayerSlots`).

Activation compares the requested set as a set: resident adapters keep their
slot, only newcomers are written (`writes`: checked first, then copied without
blocking), an adapter left out releases its slot, strength 0 keeps it warm.
Strengths live in one device tensor, [N] or [batch, N]; changing them is a
tensor write. A bank asked for more slots grows in place around its resident
adapters.

Strength shaping changes numbers only: a schedule multiplies a slot's strength
at each `set_progress`, and layer weights give a layer its own factor per slot.
After every change the bank tells each layer which of its slots are live.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import writes
from .adapter import Adapter
from .binding import Binding, MatchReport, bind
from .errors import LoRAShapeError, NonFiniteError, ShapingError, SlotLimitError
from .keymap import KeyMap
from .layer import LayerSlots, Rows
from .schedule import Schedule

Strength = float | Sequence[float] | torch.Tensor
LayerWeights = Mapping[str, float]  # layer name -> multiplier; a layer left out has 1


def _state_writes(method):
    """A `SlotBank` method that makes or writes its tensors, run outside `torch.inference_mode` and without autograd:
    the tensors it makes are then ordinary ones, which take in-place writes in either mode. One made under
    inference mode (a bank first used in a sampling; ComfyUI runs nodes so) would refuse them outside it (a later
    activation with autograd on, as a training node runs its model)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)
    return run


@dataclass(frozen=True)
class Entry:
    """One adapter of an activation. `schedule` and `layer_weights` may be one per batch item (a tuple)."""

    adapter: Adapter
    strength: Strength
    schedule: Schedule | tuple[Schedule | None, ...] | None = None
    layer_weights: LayerWeights | tuple[LayerWeights | None, ...] | None = None

    @property
    def shaped(self) -> bool:
        return self.schedule is not None or self.layer_weights is not None


@dataclass(frozen=True)
class Activation:
    """What one `activate` call did."""

    copied: tuple[str, ...]
    kept: tuple[str, ...]
    released: tuple[str, ...]
    bytes_copied: int


class SlotBank:
    """The runtime adapter state of one model. Use `SlotBank.of(root)` to share one per module. The model owns the
    bank until `release`, and the bank does not keep the model alive (`root`): hold the model while it is used."""

    BINDINGS_KEPT = 4  # bindings kept for adapters that are not resident

    @_state_writes
    def __init__(self, root: nn.Module, *, max_loras: int = 4, keymap: KeyMap | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 model_name: str | None = None, weight_fn=None, slot_rank: int = 0):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self._root = weakref.ref(root)  # weak: the root holds the bank, and a cycle would keep a dropped model alive
        self.max_loras = max_loras
        self.keymap = keymap or KeyMap(root)
        self.model_name = model_name or type(root).__name__
        self.weight_fn = weight_fn or _module_weight
        params = [p for p in root.parameters()]
        self.device = torch.device(device) if device is not None else (params[0].device if params else
                                                                       torch.device("cpu"))
        self.dtype = dtype or _compute_dtype(params)
        self.slots: list[Adapter | None] = [None] * max_loras
        self.layers: dict[str, LayerSlots] = {}
        self._bindings: OrderedDict[int, Binding] = OrderedDict()
        self.slot_rank = slot_rank
        self._strengths = torch.zeros(max_loras, dtype=self.dtype, device=self.device)
        self._item_strengths: torch.Tensor | None = None
        self.scale = self._strengths
        self._table = torch.zeros(max_loras)  # unscheduled strengths on the host, [N] or [batch, N]
        self._requested: dict[int, Strength] = {}  # each held slot's strength as its activation gave it
        self._call_table: torch.Tensor | None = None  # `set_items`: [batch, N], in place of the table until reset
        self._items: dict[int, list[float]] | None = None  # `set_items`' rows by slot (NaN: the slot's own)
        self._seen: torch.Tensor | None = None  # [N]: each slot's largest |strength| since `set_items` began
        self._schedules: dict[int, Schedule | tuple[Schedule | None, ...]] = {}
        self.progress = 0.0
        self._live_key: bytes | None = None  # the zero pattern the layers' live slots were found for
        self._columns: dict[tuple, torch.Tensor] = {}  # Rows.key -> the scale expanded to its columns
        self.generation = 0  # counts changes of the scale and the live slots; layers' cached scales follow it
        self._weights_key: tuple | None = None  # the layer weights (and batch) the layers' factors were set for
        self.all_zero = True
        self.active = False
        # The batch of the model call under way, where the host says it (None: unknown): a layer whose input has
        # other rows than that mixes the call's items, and per-item strengths are refused there (`LayerSlots`).
        self.call_rows: int | None = None
        # A host's release for a bank that no stack will use again: called by the first forward that runs while the
        # bank is inactive (the model sampled without a stack), never while a stack is active; cleared by an
        # activation.
        self.release_when_idle: Callable[[], None] | None = None
        self.lock = threading.RLock()
        self.copies = 0
        self.bytes_copied = 0
        self.reallocations = 0
        # Forward hooks made so far, one per layer that first gets a slot. torch.compile does not guard on hooks: a
        # graph traced before a hook was made runs without it, so a host that compiles the model recompiles when
        # this grows (the bridge in nodes/bridge/ resets torch.compile's caches).
        self.hooks_made = 0
        root.__dict__.setdefault(self.OWNED, []).append(self)  # the root owns its banks (`root`)
        with _BANKS_LOCK:
            _BANKS.add(self)

    # -- sharing ---------------------------------------------------------------------------------------

    ATTRIBUTE = "_lora_engine_bank"  # where a root module holds its bank (in its __dict__, not as a submodule)
    OWNED = "_lora_engine_banks"  # where it holds every bank made on it, until released

    @property
    def root(self) -> nn.Module | None:
        """The module the bank serves; None once it has been freed. The root owns its banks, from their creation
        until `release`, and each hooked module its layer's hook; the bank refers to the root, and its layers to the
        bank, weakly, so that no reference cycle keeps a model alive after its host drops it (ComfyUI takes a model
        that outlives its patchers for a leak, and its weights would stay in memory until a garbage collection)."""
        return self._root()

    @classmethod
    def attached(cls, root: nn.Module) -> SlotBank | None:
        """The bank attached to `root`, or None where it has none."""
        return root.__dict__.get(cls.ATTRIBUTE)

    @classmethod
    def of(cls, root: nn.Module, **kwargs) -> SlotBank:
        """The bank attached to `root`, created on first use, grown in place when it has fewer than
        `max_loras` slots (`grow`); its other settings are those it was created with."""
        bank = cls.attached(root)
        if bank is None:
            bank = cls(root, **kwargs)
            root.__dict__[cls.ATTRIBUTE] = bank
        else:
            bank.grow(kwargs.get("max_loras", 4))
        return bank

    @_state_writes
    def grow(self, max_loras: int) -> None:
        """At least `max_loras` slots. The resident adapters keep their slots and strengths: each layer's buffers
        are reallocated in turn, on the device, with the rows held copied there (so at most one layer's old and
        new buffers are held together), and nothing is read from the host or bound again. An error part way (out
        of memory) puts the layers already grown back to views of their first slots and leaves the bank as it
        was."""
        with self.lock:
            extra = max_loras - self.max_loras
            if extra <= 0:
                return
            grown = []
            try:
                for layer in self.layers.values():
                    layer.resize(max_loras)
                    grown.append(layer)
            except BaseException:
                for layer in grown:
                    layer.resize(self.max_loras)
                raise
            self.max_loras = max_loras
            self.slots += [None] * extra
            self._table = torch.cat([self._table, self._table.new_zeros(*self._table.shape[:-1], extra)], -1)
            self._strengths = torch.zeros(max_loras, dtype=self.dtype, device=self.device)
            self._item_strengths = None
            self._call_table = self._seen = self._items = None
            if self._weights_key is not None:
                self._set_layer_weights(*self._weights_key)
            self._live_key = None
            self._push()

    # -- binding ---------------------------------------------------------------------------------------

    def binding(self, adapter: Adapter) -> Binding:
        """The adapter bound to this model, kept while it is resident (and for a few recent others), so that
        re-running a stack binds nothing again."""
        with self.lock:
            key = id(adapter)
            b = self._bindings.get(key)
            if b is None or b.adapter is not adapter:
                b = bind(adapter, self.keymap, self.model_name)
                self._bindings[key] = b
                self._prune_bindings(keep=key)
            self._bindings.move_to_end(key)
            return b

    def _prune_bindings(self, keep: int | None = None) -> None:
        """Keep the bindings of resident adapters, and a few recent others. A binding holds its adapter,
        so keeping more would keep adapters alive that the cache has evicted."""
        extra = [k for k, b in self._bindings.items() if k != keep and not self._resident(b.adapter)]
        for k in extra[: max(0, len(extra) - self.BINDINGS_KEPT)]:
            del self._bindings[k]

    def report(self, adapter: Adapter) -> MatchReport:
        return self.binding(adapter).report

    # -- activation ------------------------------------------------------------------------------------

    @_state_writes
    def activate(self, entries: Iterable[Entry | tuple[Adapter, Strength]]) -> Activation:
        """Make exactly these adapters active, at these strengths. All-or-nothing: a bad adapter
        raises before any slot changes."""
        with self.lock:
            merged = merge(entries)
            wanted = [e.adapter for e in merged.values()]
            if len(wanted) > self.max_loras:
                names = ", ".join(a.name for a in wanted)
                raise SlotLimitError(f"{len(wanted)} adapters requested ({names}) but this model has "
                                     f"max_loras={self.max_loras} slots",
                                     remedy="raise max_loras, or disable entries in the stack")
            strengths = _strength_table([e.strength for e in merged.values()])
            batch = strengths.shape[0] if strengths.dim() == 2 else None
            _check_items(list(merged.values()), batch)
            bindings = [self.binding(a) for a in wanted]  # raises before any state changes
            staged = {id(b.adapter): writes.stage(self, b) for b in bindings if not self._resident(b.adapter)}

            previous, released = list(self.slots), []
            for i, a in enumerate(self.slots):
                if a is not None and id(a) not in merged:
                    self._clear_slot(i)
                    released.append(a.name)
            kept, copied, nbytes = [], [], 0
            for b in bindings:
                if self._resident(b.adapter):
                    kept.append(b.adapter.name)
                    continue
                slot = self.slots.index(None)
                try:
                    nbytes += writes.write(self, slot, b, staged[id(b.adapter)])
                except BaseException:
                    self._clear_slot(slot)  # a free slot is zero: the next write adds only its own pieces
                    self._abandon(previous)
                    raise
                self.slots[slot] = b.adapter
                copied.append(b.adapter.name)
            slot_of = {j: self._slot_of(a) for j, a in enumerate(wanted)}
            self._schedules = {slot_of[j]: e.schedule for j, e in enumerate(merged.values())
                               if e.schedule is not None}
            weights = {slot_of[j]: _snapshot(e.layer_weights) for j, e in enumerate(merged.values())
                       if e.layer_weights is not None}
            weights_key = (weights, batch if weights else None)
            if copied or weights_key != self._weights_key:  # a newcomer may have brought new layers
                self._set_layer_weights(weights, batch)
                self._weights_key = weights_key
            if copied or released:
                self._slots_changed()
                self._live_key = None  # slots and layers changed: find the live slots again
            self._set_strengths({slot_of[j]: strengths[:, j] if batch is not None else strengths[j]
                                 for j in range(len(wanted))}, batch=batch)
            self._requested = {slot_of[j]: e.strength for j, e in enumerate(merged.values())}
            self.active = True
            self.release_when_idle = None
            self._prune_bindings()
            self.copies += len(copied)
            self.bytes_copied += nbytes
            return Activation(tuple(copied), tuple(kept), tuple(released), nbytes)

    @_state_writes
    def set_progress(self, progress: float) -> None:
        """Apply every slot's schedule at this sampling progress (0…1): a tensor write, or nothing when
        no slot has a schedule or the progress is unchanged."""
        with self.lock:
            if not self._schedules or progress == self.progress:
                self.progress = progress
                return
            self.progress = progress
            self._push()

    @_state_writes
    def set_items(self, rows: Mapping[Adapter, Sequence[float | None]] | None) -> None:
        """Per-item strengths for the calls that follow: each adapter of `rows` takes one strength per item of the
        batch (None: its activation's strength for that item), every other resident adapter its activation's
        strength on every item. `None` goes back to the activation's strengths, as does the next activation.
        Schedules and layer weights shape these strengths as they shape the activation's. A tensor write, skipped
        when the strengths are those already set; nothing is copied or bound. A slot live (not 0) in any table set
        since the activation stays live, computing exact zeros where its strength is 0: calls that alternate
        between tables (a sampler's regions, then its negative) find no layer's live slots again. Refused (a
        `ShapingError`) where the activation itself gave per-item values (a strength grid's batch)."""
        with self.lock:
            if rows is None:
                self._items = None
                if self._call_table is not None:
                    self._call_table = None
                    self._push()  # the slots live in the tables set stay live: the next call may set them again
                return
            if self._per_item():
                raise ShapingError("this model's LoRAs already have per-item strengths (a strength grid); "
                                   "per-item strengths of another source cannot be set on top of them",
                                   remedy="sample the grid without them, or them without the grid")
            given = [float(v) for values in rows.values() for v in values if v is not None]
            if not all(math.isfinite(v) for v in given):
                raise NonFiniteError("a per-item strength is NaN or Inf", remedy="use finite strengths")
            columns = {self._slot_of(a): [math.nan if v is None else float(v) for v in values]
                       for a, values in rows.items()}
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
            self._push()

    @_state_writes
    def set_strength(self, adapter: Adapter, value: Strength) -> None:
        """Change one resident adapter's strength (a number, or one per batch item) to what an activation of the
        same set with this strength gives: a tensor write. The others keep the strengths their activation gave
        them, the schedules their progress, and `set_items`' per-item strengths stay set. Raises before anything
        changes where the strengths would not fit: per-item lengths that differ from each other or from the
        schedules' and layer weights', or per-item strengths while `set_items`' are set."""
        with self.lock:
            slot = self._slot_of(adapter)
            requested = {**self._requested, slot: value}
            held = sorted(requested)
            strengths = _strength_table([requested[s] for s in held])
            batch = strengths.shape[0] if strengths.dim() == 2 else None
            weights = self._weights_key[0] if self._weights_key is not None else {}
            _check_sizes(batch, ((self.slots[s].name, self._schedules.get(s), weights.get(s)) for s in held))
            if batch is not None and self._items is not None:
                raise ShapingError("per-item strengths cannot be set while set_items' are", path=adapter.path,
                                   remedy="call set_items(None) first")
            self._requested = requested
            if weights and self._weights_key[1] != batch:
                self._weights_key = (weights, batch)
                self._set_layer_weights(*self._weights_key)
            self._table = self._filled({s: strengths[..., j] for j, s in enumerate(held)}, batch)
            if self._items is not None:
                self._call_table = self._items_table()
            self._push()

    def deactivate(self) -> None:
        """Hooks become no-ops; slots stay warm for the next activation."""
        self.active = False

    @contextlib.contextmanager
    def using(self, entries: Iterable[tuple[Adapter, Strength]]):
        """Activate for the duration of a block: how several model objects share one base module."""
        with self.lock:
            self.activate(entries)
            try:
                yield self
            finally:
                self.deactivate()

    def release(self) -> None:
        """Free every slot and remove every hook."""
        with self.lock:
            for layer in self.layers.values():
                layer.unhook()
            self.layers.clear()
            self.slots = [None] * self.max_loras
            self._requested, self._items = {}, None
            self._bindings.clear()
            self._live_key = self._weights_key = None
            self.active = False
            self.release_when_idle = None
            with _BANKS_LOCK:
                _BANKS.discard(self)
            root = self.root
            if root is not None:
                if self.attached(root) is self:
                    del root.__dict__[self.ATTRIBUTE]
                owned = root.__dict__.get(self.OWNED, [])
                if self in owned:
                    owned.remove(self)

    @_state_writes
    def to(self, device: torch.device) -> None:
        with self.lock:
            for layer in self.layers.values():
                layer.to(device)
            self._strengths = self._strengths.to(device)
            if self._item_strengths is not None:
                self._item_strengths = self._item_strengths.to(device)
            self.scale = self.scale.to(device)
            self._columns = {}
            self.generation += 1
            self.device = torch.device(device)

    # -- state for status routes -----------------------------------------------------------------------

    @property
    def holds(self) -> bool:
        """A layer has buffers, or a slot an adapter."""
        return bool(self.layers) or any(a is not None for a in self.slots)

    def occupancy(self) -> dict:
        with self.lock:
            scale = self.scale.detach().cpu()
            return {
                "model": self.model_name, "max_loras": self.max_loras, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "active": self.active,
                "layers": len(self.layers), "bytes": sum(layer.nbytes() for layer in self.layers.values()),
                "copies": self.copies, "bytes_copied": self.bytes_copied, "reallocations": self.reallocations,
                "progress": self.progress, "scheduled_slots": sorted(self._schedules),
                "weighted_layers": sum(layer.factor is not None for layer in self.layers.values()),
                "slots": [None if a is None else {
                    "name": a.name, "fingerprint": a.fingerprint,
                    "strength": scale[i].item() if scale.dim() == 1 else scale[:, i].tolist()}
                    for i, a in enumerate(self.slots)],
            }

    # -- internals -------------------------------------------------------------------------------------

    def _per_item(self) -> bool:
        """The strengths, a schedule or layer weights are one per batch item (a strength grid's activation)."""
        weights = self._weights_key[0] if self._weights_key is not None else {}
        return self._table.dim() == 2 or any(isinstance(v, tuple) for v in
                                             (*self._schedules.values(), *weights.values()))

    def _resident(self, adapter: Adapter) -> bool:
        return any(a is adapter for a in self.slots)

    def _slot_of(self, adapter: Adapter) -> int:
        for i, a in enumerate(self.slots):
            if a is adapter:
                return i
        raise KeyError(f"{adapter.name!r} is not resident in a slot of {self.model_name}")

    def _abandon(self, previous: list[Adapter | None]) -> None:
        """After a write failed (out of memory, an interrupt): every slot whose adapter changed goes to strength
        0, so that a newcomer already written stays warm at 0 instead of taking the strength its slot's previous
        adapter had; the adapters kept compute as before."""
        self._slots_changed()
        table = self._table.clone()
        for i, (was, now) in enumerate(zip(previous, self.slots)):
            if was is not now:
                table[..., i] = 0.0
                self._requested[i] = 0.0
        self._table = table
        self._call_table = self._seen = self._items = None
        self._live_key = None
        self._push()

    def _slots_changed(self) -> None:
        """After adapters entered or left slots: zero the slots left dirty, and give each layer its dense and bias
        slots as the compiled path reads them (`LayerSlots.stack`)."""
        for layer in self.layers.values():
            if layer.dirty:
                layer.scrub()
            layer.stack()

    def _clear_slot(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        self.slots[slot] = None

    def _items_table(self) -> torch.Tensor:
        """`set_items`' table: its rows over the activation's strengths."""
        batch = len(next(iter(self._items.values())))
        table = self._table.expand(batch, self.max_loras).clone()
        for slot, values in self._items.items():
            v = torch.tensor(values)
            table[:, slot] = torch.where(v.isnan(), table[:, slot], v)
        return table

    def _filled(self, table: dict[int, torch.Tensor], batch: int | None) -> torch.Tensor:
        """The strengths table [N] or [batch, N]: `table`'s slots set, the others 0."""
        values = torch.zeros((self.max_loras,) if batch is None else (batch, self.max_loras), dtype=torch.float32)
        for i, v in table.items():
            values[..., i] = v
        return values

    def _set_strengths(self, table: dict[int, torch.Tensor], batch: int | None) -> None:
        self._table = self._filled(table, batch)
        self._call_table = self._seen = self._items = None
        self.progress = 0.0
        self._push()

    def _multipliers(self) -> torch.Tensor | None:
        """The schedules' multipliers at the current progress, [N] or [batch, N]; None without schedules."""
        if not self._schedules:
            return None
        batch = max((len(s) for s in self._schedules.values() if isinstance(s, tuple)), default=None)
        mult = torch.ones((self.max_loras,) if batch is None else (batch, self.max_loras))
        p = self.progress
        for slot, sched in self._schedules.items():
            if isinstance(sched, tuple):
                mult[:, slot] = torch.tensor([1.0 if s is None else s.at(p) for s in sched])
            else:
                mult[..., slot] = sched.at(p)
        return mult

    def _push(self) -> None:
        """Write the strengths (`set_items`' where set) times the schedules' multipliers into the device scale
        tensor."""
        values = self._table if self._call_table is None else self._call_table
        mult = self._multipliers()
        if mult is not None:
            values = values * mult
        if values.dim() == 1:
            self._strengths.copy_(values)
            self.scale = self._strengths
        else:
            if self._item_strengths is None or self._item_strengths.shape != values.shape:
                self._item_strengths = torch.empty(values.shape, dtype=self.dtype, device=self.device)
            self._item_strengths.copy_(values)
            self.scale = self._item_strengths
        self.all_zero = not bool(values.any())
        self._columns = {}
        self.generation += 1
        if self._seen is not None:  # `set_items`' tables: the slots live in any of them stay live
            self._seen = torch.maximum(self._seen, values.abs().amax(0) if values.dim() == 2 else values.abs())
            values = self._seen
        self._refresh_live(values)

    def column_scale(self, rows: Rows) -> torch.Tensor:
        """The strengths expanded to a layer's low-rank columns, [Σr] or [batch, Σr]: computed once per pattern
        of slots and ranks per strength change, and shared by every layer with that pattern."""
        cols = self._columns.get(rows.key)
        if cols is None:
            cols = self._columns[rows.key] = rows.columns(self.scale)
        return cols

    def _refresh_live(self, values: torch.Tensor) -> None:
        """Tell every layer its live slots; skipped when the zero pattern of the strengths is unchanged."""
        nonzero = values != 0
        key = bytes(nonzero.reshape(-1).tolist()) + bytes(nonzero.shape)
        if key == self._live_key:
            return
        self._live_key = key
        shared = (nonzero.any(0) if nonzero.dim() == 2 else nonzero).tolist()
        for layer in self.layers.values():
            if layer.factor_host is None:
                layer.set_live(shared)
            else:
                own = (values * layer.factor_host) != 0
                layer.set_live((own.any(0) if own.dim() == 2 else own).tolist())

    def _set_layer_weights(self, weights: dict[int, LayerWeights | tuple], batch: int | None) -> None:
        """Per-layer factors for the slots that have layer weights; every other layer and slot has 1."""
        items = max((len(w) for w in weights.values() if isinstance(w, tuple)), default=None)
        rows = items or batch
        for name, layer in self.layers.items():
            factor = None
            for slot, w in weights.items():
                per_item = w if isinstance(w, tuple) else None
                values = [1.0 if m is None else m.get(name, 1.0) for m in per_item] if per_item else \
                    [w.get(name, 1.0)]
                if all(v == 1.0 for v in values):
                    continue
                if factor is None:
                    factor = torch.ones((self.max_loras,) if rows is None else (rows, self.max_loras))
                factor[..., slot] = torch.tensor(values) if per_item else values[0]
            layer.factor_host = factor
            layer.factor = None if factor is None else factor.to(device=self.device, dtype=self.dtype)
            layer.cached_scale = None
        self._live_key = None


_BANKS: weakref.WeakSet[SlotBank] = weakref.WeakSet()
_BANKS_LOCK = threading.Lock()


def all_banks() -> list[SlotBank]:
    """Every live bank in the process, for status reporting (safe while another thread creates one)."""
    with _BANKS_LOCK:
        banks = list(_BANKS)
    return [b for b in banks if b.holds]


def occupancies() -> list[dict]:
    """Every live bank's `occupancy`, each read under the bank's lock: a bank that another thread released after
    `all_banks` listed it (ComfyUI's prompt worker unloading its model while the server reads the status) is left
    out, not listed halfway through its release."""
    out = []
    for bank in all_banks():
        with bank.lock:
            if bank.holds:
                out.append(bank.occupancy())
    return out


def merge(entries: Iterable[Entry | tuple[Adapter, Strength]]) -> dict[int, Entry]:
    """The entries of one activation, one per adapter (by id): an adapter listed more than once gets the sum of
    its strengths, and is refused when one of its entries has a schedule or layer weights (a `ShapingError`)."""
    merged: dict[int, Entry] = {}
    for item in entries:
        e = item if isinstance(item, Entry) else Entry(*item)
        prev = merged.get(id(e.adapter))
        if prev is not None and (prev.shaped or e.shaped):
            raise ShapingError(f"{e.adapter.name} appears twice in the stack and one entry has a schedule "
                               "or block weights", path=e.adapter.path, remedy="keep one entry for this LoRA")
        merged[id(e.adapter)] = e if prev is None else Entry(e.adapter, _add_strength(prev.strength, e.strength))
    return merged


def _add_strength(a: Strength, b: Strength) -> torch.Tensor:
    return torch.as_tensor(a, dtype=torch.float32) + torch.as_tensor(b, dtype=torch.float32)


def _snapshot(weights: LayerWeights | tuple[LayerWeights | None, ...]) -> dict | tuple:
    """A copy of an entry's layer weights, so that a caller's mapping edited in place and activated again is seen
    as new weights."""
    if isinstance(weights, tuple):
        return tuple(None if w is None else dict(w) for w in weights)
    return dict(weights)


def _check_items(entries: list[Entry], batch: int | None) -> None:
    """Per-item strengths, schedules and layer weights must all have one batch size."""
    _check_sizes(batch, ((e.adapter.name, e.schedule, e.layer_weights) for e in entries))


def _check_sizes(batch: int | None, shaping: Iterable[tuple[str, object, object]]) -> None:
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


def _strength_table(values: list[Strength]) -> torch.Tensor:
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


def _compute_dtype(params: list[torch.Tensor]) -> torch.dtype:
    for p in params:
        if p.is_floating_point():
            if p.element_size() == 1:
                return torch.bfloat16
            return p.dtype
    return torch.float32


def _module_weight(module: nn.Module) -> torch.Tensor:
    return module.weight.detach()
