"""Per-model slots and the activation rules.

A `SlotBank` owns `max_loras` slots on one root module. Each targeted layer holds A [N·R, in, *k] and B [out, N·R]
on the compute device, R padded to the layer's slot rank, so shapes stay fixed while adapters and strengths change
(`layer.LayerSlots`).

Activation compares the requested set as a set: resident adapters keep their slot, only newcomers are written
(`writes`: checked first, then copied without blocking), an adapter left out releases its slot, strength 0 keeps it
warm. Strengths live in one device tensor, [N] or [batch, N]; changing them is a tensor write. A bank asked for more
slots grows in place around its resident adapters.

Strength shaping changes numbers only: a schedule multiplies a slot's strength at each `set_progress`, layer weights
give a layer its own factor per slot, and masks a factor per token. The bank's strength table holds them
(`strengths.Strengths`); after every change the bank tells each layer which of its slots are live.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import banks, writes
from .adapter import Adapter
from .binding import Binding, bind
from .errors import SlotLimitError
from .keymap import KeyMap
from .layer import LayerSlots
from .regions import Region
from .report import MatchReport
from .request import Entry, Request, Strength
from .strengths import Owner, Strengths


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
class Activation:
    """What one `activate` call did."""

    copied: tuple[str, ...]
    kept: tuple[str, ...]
    released: tuple[str, ...]
    bytes_copied: int


class SlotBank:
    """The runtime adapter state of one model. Use `SlotBank.of(root)` to share one per module. The model owns the
    bank until `release`, and the bank does not keep the model alive (`root`): hold the model while it is used.
    Its strengths live in `strengths` (a `Strengths`: the scale, `active`, the host's `call_rows` and the masks'
    tokens), and what its layers and writes share of it in `owner` (an `Owner`: the model's name, dtype and device,
    the counters, `release_when_idle`); they are read and set there. The process lists it (`banks`) until `release`."""

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
        params = [p for p in root.parameters()]
        device = torch.device(device) if device is not None else (params[0].device if params else
                                                                  torch.device("cpu"))
        self.owner = Owner(model_name or type(root).__name__, dtype or _compute_dtype(params), device, slot_rank,
                           weight_fn, move=self.to)
        self.strengths = Strengths(max_loras, self.owner)
        self.slots: list[Adapter | None] = [None] * max_loras
        self._read: list[tuple] = [()] * max_loras  # per slot: the model weights its adapter was written from
        self.layers: dict[str, LayerSlots] = {}
        self._bindings: OrderedDict[int, Binding] = OrderedDict()
        self.lock = threading.RLock()
        self.copies = 0
        self.bytes_copied = 0
        root.__dict__.setdefault(self.OWNED, []).append(self)  # the root owns its banks (`root`)
        banks.add(self)

    # -- sharing ---------------------------------------------------------------------------------------

    ATTRIBUTE = "_lora_engine_bank"  # where a root module holds its bank (in its __dict__, not as a submodule)
    OWNED = "_lora_engine_banks"  # where it holds every bank made on it, until released

    @property
    def root(self) -> nn.Module | None:
        """The module the bank serves; None once it has been freed. The root owns its banks, from their creation
        until `release`, and each hooked module its layer's hook; the bank refers to the root weakly, and its
        layers do not refer to it (they hold its table and owner record, whose call back to the bank is weak), so
        that no reference cycle keeps a model alive after its host drops it (ComfyUI takes a model that outlives
        its patchers for a leak, and its weights would stay in memory until a garbage collection)."""
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
            self._read += [()] * extra
            self.strengths.grow(max_loras, self.layers)
            self._tell_layers()

    # -- binding ---------------------------------------------------------------------------------------

    def binding(self, adapter: Adapter) -> Binding:
        """The adapter bound to this model, kept while it is resident (and for a few recent others), so that
        re-running a stack binds nothing again."""
        with self.lock:
            key = id(adapter)
            b = self._bindings.get(key)
            if b is None or b.adapter is not adapter:
                b = bind(adapter, self.keymap, self.owner.model_name)
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
    def activate(self, entries: Request | Iterable[Entry | tuple[Adapter, Strength]]) -> Activation:
        """Make exactly these adapters active, at these strengths; `entries` as they are given, or a `Request`
        made of them, which is not checked again. All-or-nothing: a bad adapter raises before any slot
        changes."""
        with self.lock:
            request = Request.of(entries)
            wanted = [e.adapter for e in request.entries]
            if len(wanted) > self.max_loras:
                names = ", ".join(a.name for a in wanted)
                raise SlotLimitError(f"{len(wanted)} adapters requested ({names}) but this model has "
                                     f"max_loras={self.max_loras} slots",
                                     remedy="raise max_loras, or disable entries in the stack")
            bindings = [self.binding(a) for a in wanted]  # raises before any state changes
            # A resident adapter whose slots were made from weights the model no longer holds is written again.
            stale = {id(b.adapter) for b in bindings
                     if self._resident(b.adapter) and self._read[self._slot_of(b.adapter)] != writes.weights_read(b)}
            kept_ids = {id(b.adapter) for b in bindings if self._resident(b.adapter)} - stale
            staged = {id(b.adapter): writes.stage(self.owner, b) for b in bindings if id(b.adapter) not in kept_ids}

            previous, released = list(self.slots), []
            for i, a in enumerate(self.slots):
                if a is not None and id(a) not in kept_ids:
                    self._clear_slot(i)
                    released.append(a.name)
            kept, copied, nbytes = [], [], 0
            for b in bindings:
                if id(b.adapter) in kept_ids:
                    kept.append(b.adapter.name)
                    continue
                slot = self.slots.index(None)
                try:
                    nbytes += writes.write(self.layers, self.strengths, slot, b, staged[id(b.adapter)])
                except BaseException:
                    self._clear_slot(slot)  # a free slot is zero: the next write adds only its own pieces
                    self._abandon(previous)
                    raise
                self.slots[slot] = b.adapter
                self._read[slot] = writes.weights_read(b)
                copied.append(b.adapter.name)
            if copied or released:
                self._slots_changed()
                self.strengths.invalidate_live()  # slots and layers changed: find the live slots again
            # a newcomer may have brought new layers: their factors are made too
            self.strengths.assign(request, [self._slot_of(a) for a in wanted], self.layers, bool(copied))
            self._tell_layers()
            self.strengths.active = True
            self.owner.release_when_idle = None
            self._prune_bindings()
            self.copies += len(copied)
            self.bytes_copied += nbytes
            return Activation(tuple(copied), tuple(kept), tuple(released), nbytes)

    @_state_writes
    def set_progress(self, progress: float, steps: int | None = None) -> None:
        """Apply every slot's schedule at this sampling progress (0…1) of `steps` steps (a switch counts them): a
        tensor write, or nothing when no slot has a schedule or the progress is unchanged."""
        with self.lock:
            self.strengths.set_progress(progress, steps)
            self._tell_layers()

    @_state_writes
    def set_found(self, regions: Mapping[Adapter, Region]) -> None:
        """Masks found while sampling (`found.Finder`) on resident adapters, beside the activation's own, from the
        next call until the next `set_found` ({} takes them off) or activation."""
        with self.lock:
            self.strengths.set_found({self._slot_of(a): r for a, r in regions.items()})
            self._tell_layers()

    @_state_writes
    def set_items(self, rows: Mapping[Adapter, Sequence[float | None]] | None) -> None:
        """Per-item strengths for the calls that follow: each adapter of `rows` takes one strength per item of the
        batch (None: its activation's strength for that item), every other resident adapter its activation's
        strength on every item. `None` goes back to the activation's strengths, as does the next activation.
        Schedules and layer weights shape them as the activation's. A tensor write, skipped when the strengths are
        those already set; nothing is copied or bound. A slot live (not 0) in any table set
        since the activation stays live, computing exact zeros where its strength is 0: calls that alternate between
        tables (a sampler's regions, then its negative) find no layer's live slots again. Refused (a `ShapingError`)
        where the activation itself gave per-item values (a strength grid's batch)."""
        with self.lock:
            self.strengths.set_items(rows, self._slot_of)
            self._tell_layers()

    @_state_writes
    def set_strength(self, adapter: Adapter, value: Strength) -> None:
        """Change one resident adapter's strength (a number, or one per batch item) to what an activation of the same
        set with this strength gives: a tensor write. The others keep their strengths, the schedules their progress,
        and `set_items`' per-item strengths stay set. Raises before anything changes where the strengths would not
        fit: per-item lengths unlike each other's or the schedules' and layer weights', or beside `set_items`'."""
        with self.lock:
            slot = self._slot_of(adapter)
            names = {i: a.name for i, a in enumerate(self.slots) if a is not None}
            self.strengths.set_strength(slot, value, names, self.layers, adapter.path)
            self._tell_layers()

    @property
    def masked(self) -> bool:
        """An active entry has a mask (`Entry.region`)."""
        return bool(self.strengths.masks.regions)

    def deactivate(self) -> None:
        """Hooks become no-ops; slots stay warm for the next activation."""
        self.strengths.active = False

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
            self._read = [()] * self.max_loras
            self._bindings.clear()
            self.strengths.clear()
            self.owner.release_when_idle = None
            banks.discard(self)
            root = self.root
            if root is not None:
                if self.attached(root) is self:
                    del root.__dict__[self.ATTRIBUTE]
                owned = root.__dict__.get(self.OWNED, [])
                if self in owned:
                    owned.remove(self)

    @_state_writes
    def to(self, device: torch.device) -> None:
        """Move the slots and the strengths to `device` (a layer's hook does, when an input arrives there)."""
        with self.lock:
            self.strengths.to(device)
            for layer in self.layers.values():
                layer.to(device)
            self.owner.device = torch.device(device)

    # -- state for status routes -----------------------------------------------------------------------

    @property
    def holds(self) -> bool:
        """A layer has buffers, or a slot an adapter."""
        return bool(self.layers) or any(a is not None for a in self.slots)

    def occupancy(self) -> dict:
        with self.lock:
            owner, strengths = self.owner, self.strengths
            scale = strengths.scale.detach().cpu()
            return {
                "model": owner.model_name, "max_loras": self.max_loras, "device": str(owner.device),
                "dtype": str(owner.dtype).replace("torch.", ""), "active": strengths.active,
                "layers": len(self.layers), "bytes": sum(layer.nbytes() for layer in self.layers.values()),
                "copies": self.copies, "bytes_copied": self.bytes_copied, "reallocations": owner.reallocations,
                "progress": strengths.progress, "scheduled_slots": sorted(strengths.schedules),
                "weighted_layers": sum(layer.factor is not None for layer in self.layers.values()),
                "slots": [None if a is None else {
                    "name": a.name, "fingerprint": a.fingerprint, "masked": i in strengths.masks.regions,
                    "strength": scale[i].item() if scale.dim() == 1 else scale[:, i].tolist()}
                    for i, a in enumerate(self.slots)],
            }

    # -- internals -------------------------------------------------------------------------------------

    def _resident(self, adapter: Adapter) -> bool:
        return any(a is adapter for a in self.slots)

    def _slot_of(self, adapter: Adapter) -> int:
        for i, a in enumerate(self.slots):
            if a is adapter:
                return i
        raise KeyError(f"{adapter.name!r} is not resident in a slot of {self.owner.model_name}")

    def _abandon(self, previous: list[Adapter | None]) -> None:
        """After a write failed (out of memory, an interrupt): every slot whose adapter changed goes to strength
        0, so that a newcomer already written stays warm at 0 instead of taking the strength its slot's previous
        adapter had; the adapters kept compute as before."""
        self._slots_changed()
        self.strengths.zero(i for i, (was, now) in enumerate(zip(previous, self.slots)) if was is not now)
        self._tell_layers()

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
        self._read[slot] = ()

    def _tell_layers(self) -> None:
        """After a change of the strengths: where the table found the live slots again, give every layer its own
        (and its factors, `LayerSlots.set_live`)."""
        if self.strengths.live_changed:
            self.strengths.live_changed = False
            for layer in self.layers.values():
                layer.set_live(self.strengths)


def _compute_dtype(params: list[torch.Tensor]) -> torch.dtype:
    for p in params:
        if p.is_floating_point():
            if p.element_size() == 1:
                return torch.bfloat16
            return p.dtype
    return torch.float32
