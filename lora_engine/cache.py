"""The process-wide LRU of parsed adapters.

It is keyed by file identity (real path, size, mtime_ns, inode, ctime_ns), so an
edited or replaced file is re-read and never served stale. It is bounded by a count and a byte budget,
and safe to read from another thread (ComfyUI's server thread polls its stats
while the prompt worker loads). An adapter it has evicted while a model's slots or a stack still hold it is
served again, not read again: one file is one `Adapter` for as long as any of it lives, so that a stack naming
it twice, a grid and a conditioning's strengths all see one LoRA, and its bytes are held once.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass

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

    def as_dict(self) -> dict:
        return asdict(self)


class AdapterCache:
    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS, max_bytes: int = DEFAULT_MAX_BYTES):
        self._lock = threading.RLock()
        self._items: OrderedDict[tuple, Adapter] = OrderedDict()
        self._alive: weakref.WeakValueDictionary[tuple, Adapter] = weakref.WeakValueDictionary()  # kept or in use
        self._bytes = 0
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.hits = self.misses = self.evictions = 0

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
        holds it is taken back into the cache instead (a hit)."""
        key = (FileIdentity.of(path), convert_id)
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
            self.misses += 1
        adapter = load_adapter(path, name=name, convert=convert)
        with self._lock:
            held = self._alive.get(key)  # another thread read the same file meanwhile: serve one of the two
            if held is not None:
                adapter = held
            self._alive[key] = adapter
            self._keep(key, adapter)
        return adapter

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
                              self.max_items, self.max_bytes)

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
            _default = AdapterCache(max_items=_env_size(ENV_MAX_ITEMS, DEFAULT_MAX_ITEMS, minimum=1),
                                    max_bytes=_env_size(ENV_MAX_BYTES, DEFAULT_MAX_BYTES, minimum=0))
        return _default


_SIZE = re.compile(r"(\d+)\s*([kmg]i?b?)?", re.IGNORECASE)


def _env_size(name: str, default: int, *, minimum: int) -> int:
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
