"""The sha256 of LoRA files, each computed once per file identity: the source of the resource hashes Civitai reads.

`FileHashes.sha256(path)` reads a file in `CHUNK`-byte chunks and keeps its hex digest under the file's identity
(`FileIdentity`: real path, size, mtime_ns, inode, ctime_ns). Asked again for an unchanged file it answers from the
cache after one `stat`, opening nothing; a file changed in place (new size, mtime or ctime) or replaced (new inode)
has a new identity and is hashed again. One digest is kept per real path, the latest identity's, so the cache is
bounded by the number of files. A file that changes while it is read is refused, never cached half old, half new.

Civitai's AutoV2 hash is the first `AUTOV2` hex digits of the whole file's sha256 (`autov2`).

It is thread-safe: ComfyUI's server thread reads `stats()` while the prompt worker hashes, and two threads asking
for one file hash it once (the second waits for the first). `computed` counts the files hashed since the start,
`hits` the answers from the cache.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable

from .adapter import FileIdentity
from .errors import LoRAError, LoRAFileError

CHUNK = 8 << 20  # bytes read at a time: a flat memory cost, and a progress step per chunk
AUTOV2 = 10  # hex digits of Civitai's AutoV2 hash, as A1111's "Model hash" and Image Saver write it

Progress = Callable[[int, int], None]  # (bytes hashed, bytes in the file); it may raise to stop the work


def autov2(digest: str) -> str:
    """Civitai's AutoV2 hash from a sha256 hex digest: its first 10 digits, lowercase."""
    return digest[:AUTOV2].lower()


def _identity(real: str, st: os.stat_result) -> FileIdentity:
    return FileIdentity(real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _read_chunk(f, size: int, shown: str) -> bytes:
    try:
        return f.read(size)
    except OSError as e:
        raise LoRAFileError(f"cannot read the file to hash it ({e.strerror})", path=shown) from None


class FileHashes:
    """A process-wide cache of the sha256 of files, keyed by file identity, with counters."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = max(1, int(chunk))
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[FileIdentity, str]] = {}  # real path -> (identity, hex digest)
        self._file_locks: dict[str, threading.Lock] = {}  # one per real path: a file is hashed by one thread
        self.computed = 0  # files hashed from disk
        self.hits = 0  # answers from the cache
        self.bytes = 0  # bytes hashed from disk

    def cached(self, path: str) -> str | None:
        """The digest of the file at `path` when its current identity is cached, else None (a file that cannot be
        found is not cached); reads no file."""
        try:
            identity = FileIdentity.of(path)
        except LoRAError:
            return None
        found = self._digests.get(identity.path)  # one dict read, atomic
        return found[1] if found is not None and found[0] == identity else None

    def sha256(self, path: str, *, name: str | None = None, progress: Progress | None = None) -> str:
        """The sha256 hex digest of the file at `path`, hashed only when its identity is not cached. `name` is how
        errors name the file (the caller's name for it, not a server path); `progress(done, total)` is called after
        each chunk read."""
        shown = name if name is not None else path
        try:
            identity = FileIdentity.of(path)
        except LoRAError as e:
            raise LoRAFileError(e.message, path=shown, remedy=e.remedy) from None
        with self._lock:
            found = self._digests.get(identity.path)
            if found is not None and found[0] == identity:
                self.hits += 1
                return found[1]
            file_lock = self._file_locks.setdefault(identity.path, threading.Lock())
        with file_lock:
            found = self._digests.get(identity.path)  # another thread may have hashed it meanwhile
            if found is not None and found[0] == identity:
                with self._lock:
                    self.hits += 1
                return found[1]
            opened, digest = self._read(identity.path, shown, progress)
            with self._lock:
                self._digests[identity.path] = (opened, digest)
                self.computed += 1
                self.bytes += opened.size
        return digest

    def _read(self, real: str, shown: str, progress: Progress | None) -> tuple[FileIdentity, str]:
        """(the identity of the file as opened, its digest): refused if it changes while it is read."""
        h = hashlib.sha256()
        try:
            f = open(real, "rb")
        except OSError as e:
            raise LoRAFileError(f"cannot open the file to hash it ({e.strerror})", path=shown) from None
        with f:
            before = _identity(real, os.fstat(f.fileno()))
            done = 0
            while chunk := _read_chunk(f, self.chunk, shown):
                h.update(chunk)
                done += len(chunk)
                if progress is not None:  # outside the OSError handler: what it raises goes through untouched
                    progress(done, before.size)
            after = _identity(real, os.fstat(f.fileno()))
        if after != before or done != before.size:
            raise LoRAFileError("the file changed while it was hashed", path=shown,
                                remedy="run again once the file is completely written")
        return before, h.hexdigest()

    def stats(self) -> dict:
        """{"computed", "hits", "bytes", "files"}: files hashed, answers from the cache, bytes hashed, files held."""
        with self._lock:
            return {"computed": self.computed, "hits": self.hits, "bytes": self.bytes, "files": len(self._digests)}

    def clear(self) -> None:
        with self._lock:
            self._digests.clear()


_default: FileHashes | None = None
_default_lock = threading.Lock()


def default_hashes() -> FileHashes:
    """The process-wide `FileHashes`."""
    global _default
    with _default_lock:
        if _default is None:
            _default = FileHashes()
        return _default
