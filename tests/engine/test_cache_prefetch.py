"""The cache's reads ahead: `preload` keeps a file only where no protected file is evicted, and a file is read by one
thread at a time (a load joins a read in flight). Reads are counted by the converter each read runs once."""

from __future__ import annotations

import os
import threading
import time

import pytest

from lora_engine import AdapterCache, LoRAError, LoRAFileError, LoRAFormatError
from lora_engine.cache import Preload

from .support import lora_files as lf

WAIT = 30.0  # seconds: far above any step here; a test that hangs fails instead


@pytest.fixture
def files(tmp_path):
    model = lf.tiny()
    return [lf.write(tmp_path, f"f{i}.safetensors", lf.lora_tensors(model, "kohya", i, rank=2)) for i in range(4)]


class Reads:
    """A converter that counts the reads it runs in, and, when `gated`, holds each one until `release` is set.
    The first `failures` reads fail (as a converter that finds the file malformed)."""

    def __init__(self, gated: bool = False, failures: int = 0):
        self.count = 0
        self.failures = failures
        self.entered = threading.Event()
        self.release = threading.Event()
        if not gated:
            self.release.set()
        self._lock = threading.Lock()

    def __call__(self, tensors):
        with self._lock:
            self.count += 1
            n = self.count
        self.entered.set()
        assert self.release.wait(WAIT), "the test never released the read"
        if n <= self.failures:
            raise ValueError(f"read {n} fails on purpose")
        return tensors


class Call(threading.Thread):
    """`fn()` in a thread, its result or its exception kept."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except LoRAError as e:
            self.error = e

    def outcome(self):
        self.join(WAIT)
        assert not self.is_alive(), "the call did not return"
        return self.result


def until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def paths(cache: AdapterCache) -> set[str]:
    return {os.path.basename(e["path"]) for e in cache.entries()}


def test_preload_keeps_a_file_whose_keeping_evicts_only_unprotected_ones(files):
    cache = AdapterCache(max_items=2)
    cache.load(files[0])
    cache.load(files[1])
    before = cache.stats()
    assert cache.preload(files[2], protected=[files[1]]) is Preload.READ
    assert paths(cache) == {"f1.safetensors", "f2.safetensors"}  # f0, the oldest and unprotected, made room
    after = cache.stats()
    assert (after.hits, after.misses, after.evictions) == (before.hits, before.misses, before.evictions + 1)
    cache.load(files[2])
    assert (cache.stats().hits, cache.stats().misses) == (before.hits + 1, before.misses)


def test_preload_that_the_count_would_keep_out_reads_nothing(files):
    reads = Reads()
    cache = AdapterCache(max_items=2)
    cache.load(files[0])
    cache.load(files[1])
    assert cache.preload(files[2], protected=files[:2], convert=reads) is Preload.NOT_KEPT
    assert reads.count == 0
    assert paths(cache) == {"f0.safetensors", "f1.safetensors"} and cache.stats().evictions == 0
    cache.load(files[2], convert=reads)  # the prompt's own load reads it, by the LRU's rule
    assert reads.count == 1 and cache.stats().misses == 3


def test_preload_that_the_byte_budget_would_keep_out_is_read_and_dropped(files, tmp_path):
    one = AdapterCache().load(files[0]).nbytes
    cache = AdapterCache(max_items=10, max_bytes=int(one * 2.5))
    cache.load(files[0])
    cache.load(files[1])
    link = tmp_path / "elsewhere" / "link.safetensors"
    link.parent.mkdir()
    link.symlink_to(files[0])  # a protected file is compared by its real path
    reads = Reads()
    assert cache.preload(files[2], protected=[str(link), files[1]], convert=reads) is Preload.NOT_KEPT
    assert reads.count == 1
    assert paths(cache) == {"f0.safetensors", "f1.safetensors"} and cache.stats().bytes == 2 * one
    assert cache.preload(files[2], protected=[files[1]]) is Preload.READ
    assert paths(cache) == {"f1.safetensors", "f2.safetensors"}


def test_preload_larger_than_the_budget_is_not_kept(files):
    cache = AdapterCache(max_bytes=10)
    assert cache.preload(files[0]) is Preload.NOT_KEPT
    assert cache.stats().items == 0


def test_preload_of_a_kept_or_held_file_reads_nothing(files):
    reads = Reads()
    cache = AdapterCache(max_items=1)
    held = cache.load(files[0])
    assert cache.preload(files[0], convert=reads) is Preload.CACHED
    cache.load(files[1])  # evicts files[0], which `held` keeps alive
    assert cache.preload(files[0], convert=reads) is Preload.CACHED
    assert reads.count == 0 and cache.load(files[0]) is held


@pytest.mark.parametrize("first", ["load", "preload"])
def test_a_load_waits_for_the_read_in_flight_and_is_served_its_adapter(files, first):
    reads = Reads(gated=True)
    cache = AdapterCache()
    if first == "load":
        reader = Call(lambda: cache.load(files[0], convert=reads))
    else:
        reader = Call(lambda: cache.preload(files[0], convert=reads))
    assert reads.entered.wait(WAIT)
    assert cache.stats().reading == 1
    waiter = Call(lambda: cache.load(files[0], convert=reads))
    until(lambda: cache.stats().joined == 1, "the second load waits for the first read")
    assert waiter.is_alive() and reads.count == 1
    reads.release.set()
    served, done = waiter.outcome(), reader.outcome()
    assert reader.error is None and waiter.error is None
    assert reads.count == 1
    if first == "load":
        assert served is done
        assert (cache.stats().hits, cache.stats().misses) == (1, 1)
    else:
        assert done is Preload.READ
        assert (cache.stats().hits, cache.stats().misses) == (1, 0)  # the prompt's load read nothing
    assert cache.load(files[0], convert=reads) is served and reads.count == 1
    assert cache.stats().reading == 0


def test_a_load_joining_a_preload_that_does_not_keep_the_file_keeps_it(files):
    """The preload drops the file (it would evict a protected one), but a load already waits for it: that load is the
    prompt's own, served the adapter read, and keeps it by the LRU's rule."""
    one = AdapterCache().load(files[0]).nbytes
    cache = AdapterCache(max_items=10, max_bytes=int(one * 2.5))
    cache.load(files[0])
    cache.load(files[1])
    reads = Reads(gated=True)
    ahead = Call(lambda: cache.preload(files[2], protected=files[:2], convert=reads))
    assert reads.entered.wait(WAIT)
    waiter = Call(lambda: cache.load(files[2], convert=reads))
    until(lambda: cache.stats().joined == 1, "the load waits for the preload")
    reads.release.set()
    assert ahead.outcome() is Preload.NOT_KEPT
    adapter = waiter.outcome()
    assert waiter.error is None and reads.count == 1
    assert paths(cache) == {"f1.safetensors", "f2.safetensors"}
    assert cache.load(files[2]) is adapter


def test_a_load_waiting_on_a_failed_read_reads_the_file_itself(files):
    reads = Reads(gated=True, failures=1)
    cache = AdapterCache()
    reader = Call(lambda: cache.load(files[0], convert=reads))
    assert reads.entered.wait(WAIT)
    waiter = Call(lambda: cache.load(files[0], convert=reads))
    until(lambda: cache.stats().joined == 1, "the second load waits for the first read")
    reads.release.set()
    reader.outcome()
    adapter = waiter.outcome()
    assert isinstance(reader.error, LoRAFormatError) and "read 1 fails" in str(reader.error)
    assert waiter.error is None and adapter.layers
    assert reads.count == 2 and cache.stats().misses == 2 and cache.stats().items == 1


def test_a_file_that_fails_every_read_fails_each_waiting_load_with_its_own_error(files):
    reads = Reads(gated=True, failures=99)
    cache = AdapterCache()
    calls = [Call(lambda: cache.load(files[0], convert=reads))]
    assert reads.entered.wait(WAIT)
    calls.append(Call(lambda: cache.load(files[0], convert=reads)))
    until(lambda: cache.stats().joined == 1, "the second load waits for the first read")
    reads.release.set()
    for call in calls:
        call.outcome()
    assert all(isinstance(c.error, LoRAFormatError) for c in calls)
    assert calls[0].error is not calls[1].error and reads.count == 2
    assert cache.stats().items == 0 and cache.stats().reading == 0


def test_a_preload_of_a_corrupt_file_raises_and_leaves_no_read_behind(tmp_path):
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\xff" * 64)
    cache = AdapterCache()
    with pytest.raises(LoRAFileError):
        cache.preload(str(bad))
    s = cache.stats()
    assert (s.items, s.reading, s.hits, s.misses) == (0, 0, 0, 0)
    with pytest.raises(LoRAFileError):
        cache.load(str(bad))  # the prompt's own load reports it
    with pytest.raises(LoRAFileError):
        cache.preload(str(tmp_path / "missing.safetensors"))
