"""The process-wide LRU of parsed adapters.

It is keyed by file identity (real path, size, mtime_ns, inode, ctime_ns), so an
edited or replaced file is re-read and never served stale. It is bounded by a count and a byte budget,
and safe to read from another thread (ComfyUI's server thread polls its stats
while the prompt worker loads). An adapter it has evicted while a model's slots or a stack still hold it is
served again, not read again: one file is one `Adapter` for as long as any of it lives, so that a stack naming
it twice, a grid and a conditioning's strengths all see one LoRA, and its bytes are held once.

A file is read by one thread at a time: a `load` of a file that another thread is reading waits for that read and
is served its adapter (counted in `joined`, and as a hit). Where that read fails, the waiting load reads the file
itself, so that its own call raises its own error (or succeeds, where the file was being written meanwhile).

`preload` reads a file ahead of the prompt that will load it (a server's prefetch of a queued prompt) and keeps it
only where that evicts none of the `protected` files (the running prompt's): the cache's bounds hold, and a LoRA in
use is never dropped for one that is not yet. It counts no hit and no miss: `hits` and `misses` count `load`s, and
`misses` the loads that read their file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import Enum

from .adapter import Adapter, Converter, FileIdentity, load_adapter

DEFAULT_MAX_ITEMS = 16
DEFAULT_MAX_BYTES = 4 * 1024**3
# Read once, when the process-wide cache is first created: a server's budget without code changes.
ENV_MAX_ITEMS = "MULTILORA_CACHE_MAX_ITEMS"
ENV_MAX_BYTES = "MULTILORA_CACHE_MAX_BYTES"

log = logging.getLogger("lora_engine")


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    items: int
    bytes: int
    max_items: int
    max_bytes: int
    joined: int = 0  # loads served by another thread's read of the same file
    reading: int = 0  # files being read now

    def as_dict(self) -> dict:
        return asdict(self)


class Preload(str, Enum):
    """What `AdapterCache.preload` did with a file."""

    READ = "read"  # read, and kept
    CACHED = "cached"  # already kept, held, or being read: nothing to do
    NOT_KEPT = "not_kept"  # keeping it would evict a protected file, or it is larger than the byte budget


class _Read:
    """One read in flight: the thread that reads sets `adapter` (None where the read failed), then `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.adapter: Adapter | None = None


class AdapterCache:
    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS, max_bytes: int = DEFAULT_MAX_BYTES):
        self._lock = threading.RLock()
        self._items: OrderedDict[tuple, Adapter] = OrderedDict()
        self._alive: weakref.WeakValueDictionary[tuple, Adapter] = weakref.WeakValueDictionary()  # kept or in use
        self._reading: dict[tuple, _Read] = {}
        self._bytes = 0
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.hits = self.misses = self.evictions = self.joined = 0

    def configure(self, *, max_items: int | None = None, max_bytes: int | None = None) -> None:
        with self._lock:
            if max_items is not None:
                self.max_items = max(1, int(max_items))
            if max_bytes is not None:
                self.max_bytes = max(0, int(max_bytes))
            self._evict()

    def load(self, path: str, *, name: str | None = None, convert: Converter | None = None,
             convert_id: str = "") -> Adapter:
        """The parsed adapter for `path`, read from disk only on a miss: one that was evicted while something still
        holds it is taken back into the cache instead (a hit), and one that another thread is reading is waited
        for (a hit; read again here only where that read failed)."""
        key = (FileIdentity.of(path), convert_id)
        while True:
            with self._lock:
                hit = self._items.get(key)
                if hit is not None:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return hit
                held = self._alive.get(key)
                if held is not None:
                    self.hits += 1
                    self._keep(key, held)
                    return held
                pending = self._reading.get(key)
                if pending is None:
                    self.misses += 1
                    pending = self._reading[key] = _Read()
                    break
                self.joined += 1
            pending.done.wait()
            if pending.adapter is not None:
                with self._lock:
                    self.hits += 1
                    adapter = self._alive.setdefault(key, pending.adapter)
                    if key in self._items:
                        self._items.move_to_end(key)
                    else:  # a preload that did not keep it: this load is the prompt's own, and keeps it
                        self._keep(key, adapter)
                return adapter
            # The read failed: loop, and read it here (or join another thread's newer read).
        with self._finishing(key, pending):
            adapter = load_adapter(path, name=name, convert=convert)
            with self._lock:
                adapter = self._alive.setdefault(key, adapter)
                self._keep(key, adapter)
                pending.adapter = adapter
        return adapter

    def preload(self, path: str, *, protected: Iterable[str] = (), name: str | None = None,
                convert: Converter | None = None, convert_id: str = "") -> Preload:
        """Read `path` into the cache ahead of its use, keeping it only where that evicts none of the files in
        `protected` (paths; compared by real path) and it fits the byte budget. A file the count bound alone would
        keep out is not read at all; one that turns out too large once read is dropped, and its first `load` reads
        it again. Raises the read's `LoRAError` as `load` does. A `load` of the file meanwhile waits for this read
        and is served its adapter, kept or not."""
        key = (FileIdentity.of(path), convert_id)
        guarded = {os.path.realpath(p) for p in protected}
        with self._lock:
            if key in self._items or key in self._alive or key in self._reading:
                return Preload.CACHED
            if not self._fits(0, guarded):
                return Preload.NOT_KEPT
            pending = self._reading[key] = _Read()
        with self._finishing(key, pending):
            adapter = load_adapter(path, name=name, convert=convert)
            with self._lock:
                adapter = self._alive.get(key, adapter)  # a load in another thread may have read it too
                kept = key in self._items or self._fits(adapter.nbytes, guarded)
                if kept and key not in self._items:
                    self._alive[key] = adapter
                    self._keep(key, adapter)
                pending.adapter = adapter
        return Preload.READ if kept else Preload.NOT_KEPT

    def _fits(self, nbytes: int, protected: set[str]) -> bool:
        """Whether one more adapter of `nbytes` could be kept without evicting a file in `protected`: the same LRU
        walk as `_evict`, counted without removing anything. Call under the lock."""
        count, total = len(self._items) + 1, self._bytes + nbytes
        for (identity, _), adapter in self._items.items():
            if count <= self.max_items and total <= self.max_bytes:
                break
            if identity.path in protected:
                return False
            count, total = count - 1, total - adapter.nbytes
        return total <= self.max_bytes

    @contextlib.contextmanager
    def _finishing(self, key: tuple, pending: _Read):
        """Around one read: whatever happens, the read leaves the registry and its waiters wake (to its adapter, or,
        where it failed, to read the file themselves)."""
        try:
            yield
        finally:
            with self._lock:
                self._reading.pop(key, None)
            pending.done.set()

    def _keep(self, key: tuple, adapter: Adapter) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._items[key] = adapter
        self._bytes += adapter.nbytes
        self._evict(keep=key)

    def _evict(self, keep: tuple | None = None) -> None:
        for key in list(self._items):
            if len(self._items) <= self.max_items and self._bytes <= self.max_bytes:
                return
            if key != keep:
                self._bytes -= self._items.pop(key).nbytes
                self.evictions += 1
        if keep in self._items and self._bytes > self.max_bytes:
            # One adapter larger than the whole budget is served, but not kept.
            self._bytes -= self._items.pop(keep).nbytes
            self.evictions += 1

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, self.evictions, len(self._items), self._bytes,
                              self.max_items, self.max_bytes, self.joined, len(self._reading))

    def entries(self) -> list[dict]:
        with self._lock:
            return [{"name": a.name, "path": a.path, "bytes": a.nbytes, "fingerprint": a.fingerprint,
                     "formats": list(a.formats), "layers": len(a.layers)} for a in self._items.values()]

    def snapshot(self) -> dict:
        """`stats()` and `entries()` read under one lock, so that a reader on another thread sees counters
        and entries that agree (bytes equals the sum of the entries' bytes)."""
        with self._lock:
            return {**self.stats().as_dict(), "entries": self.entries()}

    def clear(self) -> None:
        """Forget every adapter: the next load of any file reads it again, even one that is still in use."""
        with self._lock:
            self._items.clear()
            self._alive.clear()
            self._bytes = 0


_default: AdapterCache | None = None
_default_lock = threading.Lock()


def default_cache() -> AdapterCache:
    """The cache shared by every model and node in this process. Its bounds come from
    $MULTILORA_CACHE_MAX_ITEMS and $MULTILORA_CACHE_MAX_BYTES (an integer, or with a K, M or G suffix
    in powers of 1024) when they are set as it is created, else the defaults."""
    global _default
    with _default_lock:
        if _default is None:
            _default = AdapterCache(max_items=env_size(ENV_MAX_ITEMS, DEFAULT_MAX_ITEMS, minimum=1),
                                    max_bytes=env_size(ENV_MAX_BYTES, DEFAULT_MAX_BYTES, minimum=0))
        return _default


_SIZE = re.compile(r"(\d+)\s*([kmg]i?b?)?", re.IGNORECASE)


def env_size(name: str, default: int, *, minimum: int) -> int:
    """The size in $`name` (an integer, optionally with a K, M or G suffix), at least `minimum`; `default` where
    unset or unreadable (with a warning)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    m = _SIZE.fullmatch(raw)
    if m is None:
        log.warning("[MultiLoRA] ignoring %s=%r: expected an integer, optionally with a K, M or G suffix; "
                    "using %d", name, raw, default)
        return default
    unit = (m.group(2) or " ")[0].lower()
    return max(minimum, int(m.group(1)) * {" ": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit])
