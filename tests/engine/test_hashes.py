"""The file-hash cache: chunked sha256 equal to hashlib's over the whole bytes, one hash per file identity, a rehash
after an in-place change, counters, progress, refusals and threads."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from lora_engine import LoRAFileError
from lora_engine.hashes import AUTOV2, FileHashes, autov2, default_hashes


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def bump_mtime(path: str, ns: int = 1_000_000_000) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + ns))


@pytest.mark.parametrize("size, chunk", [(0, 7), (1, 7), (7, 7), (100, 7), (1000, 1), (3 << 20, 1 << 20),
                                         (5_000_003, 8 << 20)])
def test_chunked_digest_equals_hashlib_over_the_whole_bytes(tmp_path, size, chunk):
    data = os.urandom(size)
    path = write(tmp_path / "f.safetensors", data)
    assert FileHashes(chunk=chunk).sha256(path) == hashlib.sha256(data).hexdigest()


def test_autov2_is_the_first_ten_lowercase_hex_digits():
    digest = hashlib.sha256(b"lora").hexdigest()
    assert autov2(digest) == digest[:10] and autov2(digest.upper()) == digest[:10] and AUTOV2 == 10


def test_an_unchanged_file_is_hashed_once(tmp_path):
    path = write(tmp_path / "a.safetensors", b"a" * 1000)
    hashes = FileHashes(chunk=64)
    first = hashes.sha256(path)
    assert hashes.stats() == {"computed": 1, "hits": 0, "bytes": 1000, "files": 1}
    for _ in range(3):
        assert hashes.sha256(path) == first
    assert hashes.cached(path) == first
    assert hashes.stats() == {"computed": 1, "hits": 3, "bytes": 1000, "files": 1}


def test_a_link_to_a_hashed_file_is_that_file(tmp_path):
    path = write(tmp_path / "a.safetensors", b"linked")
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    hashes = FileHashes()
    assert hashes.sha256(str(link)) == hashes.sha256(path)
    assert hashes.stats()["computed"] == 1


def test_a_file_rewritten_in_place_with_the_same_size_is_hashed_again(tmp_path):
    old, new = b"x" * 4096, b"y" * 4096
    path = write(tmp_path / "a.safetensors", old)
    hashes = FileHashes(chunk=1024)
    assert hashes.sha256(path) == hashlib.sha256(old).hexdigest()
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(new)
    bump_mtime(path)
    assert hashes.cached(path) is None
    assert hashes.sha256(path) == hashlib.sha256(new).hexdigest()
    assert hashes.stats()["computed"] == 2 and hashes.stats()["files"] == 1  # one digest a path, the latest
    assert hashes.sha256(path) == hashlib.sha256(new).hexdigest()
    assert hashes.stats()["computed"] == 2


def test_a_file_of_another_size_is_hashed_again(tmp_path):
    path = write(tmp_path / "a.safetensors", b"short")
    hashes = FileHashes()
    hashes.sha256(path)
    write(tmp_path / "a.safetensors", b"longer content")
    assert hashes.sha256(path) == hashlib.sha256(b"longer content").hexdigest()
    assert hashes.stats()["computed"] == 2


def test_progress_reports_each_chunk_up_to_the_size(tmp_path):
    path = write(tmp_path / "a.safetensors", b"z" * 2500)
    seen = []
    FileHashes(chunk=1000).sha256(path, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1000, 2500), (2000, 2500), (2500, 2500)]


def test_an_error_raised_by_progress_stops_the_work_and_caches_nothing(tmp_path):
    path = write(tmp_path / "a.safetensors", b"z" * 2500)
    hashes = FileHashes(chunk=1000)

    def stop(done, total):
        raise InterruptedError("cancelled")  # an OSError: not taken for a read error

    with pytest.raises(InterruptedError):
        hashes.sha256(path, progress=stop)
    assert hashes.cached(path) is None and hashes.stats()["computed"] == 0


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path):
    path = write(tmp_path / "a.safetensors", b"z" * 3000)
    hashes = FileHashes(chunk=1000)

    def grow(done, total):
        if done == 1000:
            with open(path, "ab") as f:
                f.write(b"more")

    with pytest.raises(LoRAFileError, match="changed while it was hashed") as e:
        hashes.sha256(path, name="a.safetensors", progress=grow)
    assert e.value.path == "a.safetensors"
    assert hashes.stats()["computed"] == 0
    assert hashes.sha256(path) == hashlib.sha256(b"z" * 3000 + b"more").hexdigest()


def test_a_missing_file_is_a_file_error_that_names_it_as_asked(tmp_path):
    with pytest.raises(LoRAFileError) as e:
        FileHashes().sha256(str(tmp_path / "gone.safetensors"), name="sub/gone.safetensors")
    assert e.value.path == "sub/gone.safetensors" and str(tmp_path) not in str(e.value)
    assert FileHashes().cached(str(tmp_path / "gone.safetensors")) is None


def test_threads_asking_for_one_file_hash_it_once(tmp_path):
    data = os.urandom(1 << 20)
    path = write(tmp_path / "a.safetensors", data)
    hashes = FileHashes(chunk=4096)
    start, out = threading.Barrier(8), []

    def ask():
        start.wait()
        out.append(hashes.sha256(path))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [hashlib.sha256(data).hexdigest()] * 8
    assert hashes.stats()["computed"] == 1 and hashes.stats()["hits"] == 7


def test_a_file_hashed_through_the_process_wide_cache_is_read_once_for_every_caller(tmp_path):
    """The nodes, the routes and the save path each ask `default_hashes()`, some on threads of their own, the first
    ones at once: the file is read once, and every later caller is answered from what the first one read."""
    data = os.urandom(1 << 16)
    path = write(tmp_path / "shared.safetensors", data)
    start, out = threading.Barrier(4), []

    def first_callers():
        start.wait()
        out.append(default_hashes().sha256(path))

    before = default_hashes().stats()
    threads = [threading.Thread(target=first_callers) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    later = default_hashes().sha256(path)
    after = default_hashes().stats()
    assert out == [later] * 4 and later == hashlib.sha256(data).hexdigest()
    assert after["computed"] - before["computed"] == 1 and after["hits"] - before["hits"] == 4
