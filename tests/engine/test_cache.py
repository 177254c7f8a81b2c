"""The process-wide LRU: identity keys, count and byte bounds, counters, threads."""

from __future__ import annotations

import os
import threading

import pytest

from lora_engine import AdapterCache, default_cache
from lora_engine import cache as cache_mod

from .support import lora_files as lf


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


@pytest.mark.parametrize("how", ["renamed over it", "rewritten in place"])
def test_a_same_size_replacement_with_the_old_mtime_is_reread(files, tmp_path, how):
    cache = AdapterCache()
    first = cache.load(files[0])
    st = os.stat(files[0])
    new = lf.write(tmp_path, "other.safetensors", lf.lora_tensors(lf.tiny(), "kohya", 99, rank=2))
    assert os.path.getsize(new) == st.st_size  # same shapes: only the content tells them apart
    if how == "renamed over it":
        os.replace(new, files[0])
    else:
        with open(new, "rb") as src, open(files[0], "r+b") as dst:
            dst.write(src.read())
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p and rsync -a leave it
    assert (os.stat(files[0]).st_size, os.stat(files[0]).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = cache.load(files[0])
    assert second is not first and second.fingerprint != first.fingerprint


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


def test_snapshot_counters_agree_with_entries_under_concurrent_loads(files):
    """What GET /multilora/status returns: read from another thread while loads evict, bytes always
    equals the sum of the entries' bytes."""
    cache = AdapterCache(max_items=2)
    done = threading.Event()
    errors = []

    def loader():
        try:
            for j in range(40):
                cache.load(files[j % len(files)])
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=loader)
    t.start()
    reads = 0
    while not done.is_set() and reads < 100_000:
        snap = cache.snapshot()
        assert snap["bytes"] == sum(e["bytes"] for e in snap["entries"]) and snap["items"] == len(snap["entries"])
        reads += 1
    t.join(timeout=60)
    assert not errors and reads


@pytest.mark.parametrize("items,nbytes,want", [
    ("3", "5M", (3, 5 * 1024**2)),
    ("0", "1024", (1, 1024)),                         # at least one item
    ("many", "2 GiB", (cache_mod.DEFAULT_MAX_ITEMS, 2 * 1024**3)),  # an unreadable value keeps the default
    (None, None, (cache_mod.DEFAULT_MAX_ITEMS, cache_mod.DEFAULT_MAX_BYTES)),
])
def test_default_cache_budget_from_the_environment(monkeypatch, items, nbytes, want):
    for name, value in ((cache_mod.ENV_MAX_ITEMS, items), (cache_mod.ENV_MAX_BYTES, nbytes)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(cache_mod, "_default", None)  # as in a fresh process; restored afterwards
    s = default_cache().stats()
    assert (s.max_items, s.max_bytes) == want


def test_an_evicted_adapter_still_in_use_is_served_again_not_read_again(files):
    """One file is one Adapter while any holder keeps it: a stack naming it again after the LRU dropped it (or after
    a file larger than the budget was served and not kept) gets the same object, so that the engine's rules for a
    LoRA listed twice see one LoRA, and its bytes are held once. Once nothing holds it, it is read again."""
    cache = AdapterCache(max_items=1)
    held = cache.load(files[0])
    cache.load(files[1])  # evicts files[0]
    assert cache.stats().evictions == 1
    assert cache.load(files[0]) is held
    s = cache.stats()
    assert (s.hits, s.misses, s.items) == (1, 2, 1) and cache.entries()[0]["path"] == held.path
    fingerprint = held.fingerprint
    del held
    cache.load(files[1])  # evicts files[0] again, which nothing holds now
    again = cache.load(files[0])
    assert again.fingerprint == fingerprint and cache.stats().misses == 4

    big = AdapterCache(max_bytes=10)
    first = big.load(files[2])
    assert big.stats().items == 0 and big.load(files[2]) is first
