"""The LoRA library that the picker shows: every file of the loras folders with its preview image and a summary of
its header and sidecar files, cached by file identity.

`Library.listing()` takes the names ComfyUI lists for "loras" (`bridge.lora_names`, which ComfyUI's "Refresh"
lists again) and, for each folder that holds some, lists that folder in each configured root once. That one listing
says which files, preview images and sidecars exist, and its stats give each file's identity (real path, size,
mtime_ns, inode). A summary is read (the safetensors header and the sidecar JSON, never a tensor) only when the
identity of the file or of one of its sidecars is not in the cache: listing an unchanged library again opens no file.

`warm_up()` reads the summaries once in a thread when the server starts, so that the first open of the picker
finds them cached.

The listing is compact (format 2), as the route sends it: each folder once, with its files as rows of values in the
order of `FIELDS`, a value left out at the end of a row when it has none:

    {"format": 2, "fields": ["base_model", "rank", ...], "reads": 0,
     "folders": [["flux/characters/", [["alice_v2.safetensors", "SD1.x", 4, "2.0", "LoRA", ["alice"], <ETag>],
                                       ["bob.safetensors", "SD1.x", 4, null, "LoRA"], ...]], ...]}

A folder is the part of the names that ComfyUI lists before the file's own name, separator included ("" at the
top), so that folder + file is the name exactly; web/library.js `parseListing` turns it back into one object a file.

Confinement: a file, preview or sidecar is opened only when its real path, links followed, is inside one of the
configured loras folders, as `bridge.resolve` requires of every name the pack opens. A LoRA whose link escapes is
listed with an error and never opened. Errors name files as the loras folder names them, never by server paths.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict

from ..lora_engine import LoRAError, LoRAFileError, read_header
from ..lora_engine.stack.lora_info import describe
from . import bridge
from . import triggers

# The images that LoRA Manager, Civitai Helper and pysssss put beside `<stem>.safetensors`, in the order looked for.
PREVIEW_SUFFIXES = (".preview.png", ".preview.jpg", ".preview.jpeg", ".preview.webp", ".png")
CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
SIDECAR_SUFFIXES = tuple(suffix for suffix, _ in triggers.SIDECARS)
MAX_PREVIEW = 32 << 20  # bytes
MAX_TRIGGERS = 16
LISTING_FORMAT = 2
# The values of a file's row after its name, the ones most files have first, so that most rows end early.
FIELDS = ("base_model", "rank", "alpha", "format", "triggers", "preview", "title", "weight", "sidecar_error", "error")
PREVIEW_AT = FIELDS.index("preview")
log = logging.getLogger("multilora")


def etag(st: os.stat_result) -> str:
    """An HTTP entity tag from a file's identity: inode, size and modification time in nanoseconds."""
    return f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _inside(real: str, roots: list[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _scan(directory: str) -> dict[str, os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return {e.name: e for e in it}
    except OSError:
        return {}


def _stem(name: str) -> str:
    return os.path.splitext(name)[0]


class PreviewError(LoRAFileError):
    """A preview image that is refused (a name outside the loras folders) or that is not there (`missing`)."""

    def __init__(self, message: str, *, path: str, missing: bool = False, remedy: str | None = None):
        super().__init__(message, path=path, remedy=remedy)
        self.missing = missing


class Library:
    """The listing of the loras folders, with a cache of file summaries keyed by file identity."""

    def __init__(self):
        self._lock = threading.Lock()
        self._summaries: dict[str, tuple[tuple, tuple]] = {}  # real path -> (identity, values of FIELDS)
        self.reads = 0  # summaries read from disk since the start: each one a header and its sidecars

    def listing(self) -> dict:
        """The compact listing of the module's docstring: every file ComfyUI lists for "loras", by folder, with its
        preview's ETag and its summary; `reads` counts the summaries read now."""
        names = bridge.lora_names()
        roots = bridge.folder_roots("loras")
        real_roots = [os.path.realpath(r) for r in roots]
        by_prefix: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_prefix[name[:len(name) - len(os.path.basename(name))]].append(name)
        folders, seen, reads = [], {}, 0
        for prefix, members in by_prefix.items():
            scans = []
            for root in roots:
                directory = os.path.join(root, os.path.dirname(members[0]))
                real_dir = os.path.realpath(directory)
                scans.append((_scan(directory), real_dir, _inside(real_dir, real_roots)))
            rows = []
            for name in members:
                row, read = self._row(name, name[len(prefix):], scans, real_roots, seen)
                rows.append(row)
                reads += read
            folders.append([prefix, rows])
        with self._lock:
            self._summaries = {p: v for p, v in self._summaries.items() if p in seen}
        return {"format": LISTING_FORMAT, "fields": list(FIELDS), "folders": folders, "reads": reads}

    def _row(self, name: str, base: str, scans: list, roots: list[str], seen: dict) -> tuple[list, int]:
        """(the file's row of the listing, 1 if its summary was read now else 0)."""
        for scan, real_dir, dir_inside in scans:
            e = scan.get(base)
            if e is None or not e.is_file():
                continue
            link = e.is_symlink()
            real = os.path.realpath(e.path) if link or not dir_inside else os.path.join(real_dir, base)
            if (link or not dir_inside) and not _inside(real, roots):
                return _trim([base, *_values({"error": f"{name!r} resolves outside the configured loras folders (a "
                                                        "symlink escapes)"})]), 0
            values, read = self.summary(name, real, e.stat(), self._sidecars(real, scan, real_dir, roots))
            seen[real] = True
            row = [base, *values]
            preview = self._preview(base, scan, roots)
            if preview:
                row[1 + PREVIEW_AT] = preview
            return _trim(row), read
        return _trim([base, *_values({"error": f"{name!r} is no longer in the loras folders (press Refresh)"})]), 0

    @staticmethod
    def _preview(base: str, scan: dict, roots: list[str]) -> str | None:
        stem = _stem(base)
        for suffix in PREVIEW_SUFFIXES:
            e = scan.get(stem + suffix)
            if e is not None and e.is_file() and (not e.is_symlink() or _inside(os.path.realpath(e.path), roots)):
                return etag(e.stat())
        return None

    @staticmethod
    def _sidecars(real: str, scan: dict, real_dir: str, roots: list[str]) -> tuple:
        """For each sidecar of the file at `real`: None when missing, else (its identity, whether it is inside the
        loras folders). A part of the cache key; the folder's listing spares a stat of each missing one."""
        stem = _stem(real)
        here = os.path.dirname(stem) == real_dir  # not for a LoRA linked from elsewhere: its sidecars are there
        base = os.path.basename(stem)
        out = []
        for suffix in SIDECAR_SUFFIXES:
            e = scan.get(base + suffix) if here else None
            try:
                st = e.stat() if e is not None else None if here else os.stat(stem + suffix)
            except OSError:
                st = None
            link = e.is_symlink() if e is not None else not here
            out.append(None if st is None else (_identity(st), not link or _inside(os.path.realpath(stem + suffix),
                                                                                    roots)))
        return tuple(out)

    def summary(self, name: str, real: str, st: os.stat_result, sidecars: tuple) -> tuple[tuple, int]:
        """(the values of FIELDS that the summary of the LoRA at `real` gives, 1 if it was read now else 0), from the
        cache when its identity and its sidecars' are the ones cached."""
        key = (_identity(st), sidecars)
        cached = self._summaries.get(real)  # one dict read, atomic: the listing of 5,000 files takes no lock each
        if cached is not None and cached[0] == key:
            return cached[1], 0
        values = _values(read_summary(name, real, confined={i: s[1] for i, s in enumerate(sidecars) if s is not None}))
        with self._lock:
            self._summaries[real] = (key, values)
            self.reads += 1
        return values, 1

    def preview(self, name: str) -> tuple[str, str, os.stat_result]:
        """(real path, content type, stat) of the preview image of the LoRA `name`, or a `PreviewError` that names
        the file as asked: refused for a name that is not plainly inside the loras folders, missing otherwise."""
        try:
            bridge.check_relative(name, "loras")
        except LoRAFileError as e:
            raise PreviewError(e.message, path=name, remedy=e.remedy) from None
        stem = _stem(name)
        for suffix in PREVIEW_SUFFIXES:
            candidate = stem + suffix
            if not any(os.path.lexists(os.path.join(r, candidate)) for r in bridge.folder_roots("loras")):
                continue
            try:
                real = bridge.resolve("loras", candidate, show_folders=False)
            except LoRAFileError as e:
                raise PreviewError(e.message, path=candidate, remedy=e.remedy) from None
            return real, CONTENT_TYPES["." + suffix.rsplit(".", 1)[1]], os.stat(real)
        raise PreviewError(f"no preview image for {name!r} (looked for {', '.join(PREVIEW_SUFFIXES)} beside it)",
                           path=name, missing=True, remedy="put <name>.preview.png beside the LoRA")


def _values(entry: dict) -> tuple:
    """The values of `entry` in the order of FIELDS, None where it has none."""
    return tuple(entry.get(k) for k in FIELDS)


def _trim(row: list) -> list:
    """A row of the listing without the Nones at its end (its first value, the file's name, is never None)."""
    while row[-1] is None:
        row.pop()
    return row


def read_summary(name: str, real: str, confined: dict[int, bool]) -> dict:
    """What the picker's card shows of one LoRA: its header's family, rank, alpha, format and title, its trigger words
    and its sidecars' preferred weight. A file that cannot be read gets `error`; sidecars that cannot, `sidecar_error`."""
    try:
        header = read_header(real)
        shapes = {key: info.shape for key, info in header.tensors.items()}
        metadata = header.metadata
        info = describe(shapes, metadata)
        error = None
    except LoRAError as e:
        info, metadata = {}, {}
        error = str(type(e)(e.message, path=name, key=e.key, remedy=e.remedy))
    side = triggers.read_sidecars(real, allowed=lambda i: confined.get(i, True))
    out = {
        "base_model": info.get("base_model"), "rank": info.get("rank"), "alpha": info.get("alpha"),
        "format": info.get("format"), "title": info.get("title"),
        "triggers": triggers.trigger_words(metadata, side["words"])[:MAX_TRIGGERS],
        "weight": side["weight"], "sidecar_error": "; ".join(side["unreadable"]) or None, "error": error,
    }
    return {k: v for k, v in out.items() if v not in (None, [])}


LIBRARY = Library()


def warm_up() -> threading.Thread:
    """Reads every LoRA's summary into the cache in a daemon thread, and says in the log how many it read and how long
    it took; an error is logged, never raised (the listing reads the files again when the picker asks)."""
    def run():
        started = time.perf_counter()
        try:
            reads = LIBRARY.listing()["reads"]
        except Exception as e:  # noqa: BLE001: a warm-up must not take the server down
            log.warning("[MultiLoRA] the LoRA library was not read at start (%s: %s); the picker reads it when opened",
                        type(e).__name__, e)
            return
        if reads:
            log.info("[MultiLoRA] LoRA library: %d summaries read in %.2f s", reads, time.perf_counter() - started)
    thread = threading.Thread(target=run, name="multilora-library-warm-up", daemon=True)
    thread.start()
    return thread
