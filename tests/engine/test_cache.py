"""The process-wide LRU: identity keys, count and byte bounds, counters, threads."""

from __future__ import annotations

import os
import threading

import pytest

from lora_engine import AdapterCache, default_cache

from . import lora_files as lf


@pytest.fixture
def files(tmp_path):
    model = lf.tiny()
    return [lf.write(tmp_path, f"f{i}.safetensors", lf.lora_tensors(model, "kohya", i, rank=2)) for i in range(4)]


def test_hits_and_misses(files):
    cache = AdapterCache(max_items=8)
    a = cache.load(files[0])
    assert cache.load(files[0]) is a
    s = cache.stats()
    assert (s.hits, s.misses, s.items, s.bytes) == (1, 1, 1, a.nbytes)


def test_edited_file_is_reread(files, tmp_path):
    cache = AdapterCache()
    first = cache.load(files[0])
    model = lf.tiny()
    lf.write(tmp_path, "f0.safetensors", lf.lora_tensors(model, "kohya", 99, rank=2))
    st = os.stat(files[0])
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = cache.load(files[0])
    assert second is not first and second.fingerprint != first.fingerprint
    assert cache.stats().misses == 2


def test_same_content_under_two_names_has_one_fingerprint(files, tmp_path):
    import shutil
    copy = shutil.copy(files[1], tmp_path / "copy.safetensors")
    cache = AdapterCache()
    assert cache.load(files[1]).fingerprint == cache.load(str(copy)).fingerprint


def test_evicts_by_count(files):
    cache = AdapterCache(max_items=2)
    for f in files[:3]:
        cache.load(f)
    s = cache.stats()
    assert (s.items, s.evictions) == (2, 1)
    cache.load(files[0])  # the oldest was evicted: a miss
    assert cache.stats().misses == 4


def test_lru_order(files):
    cache = AdapterCache(max_items=2)
    cache.load(files[0])
    cache.load(files[1])
    cache.load(files[0])  # now files[1] is least recently used
    cache.load(files[2])
    cache.load(files[0])
    assert cache.stats().hits == 2


def test_evicts_by_bytes(files):
    one = AdapterCache().load(files[0]).nbytes
    cache = AdapterCache(max_items=10, max_bytes=int(one * 2.5))
    for f in files:
        cache.load(f)
    s = cache.stats()
    assert s.items == 2 and s.bytes <= s.max_bytes and s.evictions == 2


def test_adapter_larger_than_budget_is_served_not_kept(files):
    cache = AdapterCache(max_bytes=10)
    assert cache.load(files[0]).layers
    assert cache.stats().items == 0


def test_concurrent_loads_and_stats(files):
    cache = AdapterCache(max_items=2)
    errors = []

    def worker(i):
        try:
            for j in range(20):
                cache.load(files[(i + j) % len(files)])
                s = cache.stats()
                assert s.items <= 2 and s.bytes >= 0
                cache.entries()
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    s = cache.stats()
    assert s.hits + s.misses == 80 and s.items <= 2
    assert s.bytes == sum(e["bytes"] for e in cache.entries())


def test_default_cache_is_one_per_process():
    assert default_cache() is default_cache()
