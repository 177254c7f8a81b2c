"""LoRAStackHashes, and the `lora_hashes` text of a stack: A1111's `Lora hashes` value, by which Civitai links an
image to the LoRAs that made it.

The text is `name: hash` for each LoRA of the stack whose strength is not 0, comma-joined in stack order:

    sks_dog: 1a2b3c4d5e, style: 0f9e8d7c6b

- hash: Civitai's AutoV2, the first 10 hex digits of the sha256 of the whole file, lowercase (`lora_engine.hashes`).
  It is computed once per file identity and kept in the engine's process-wide cache: a second run hashes nothing.
- name: the file's stem, as A1111 names a LoRA in `<lora:name:w>` (its file name without folders and extension),
  without ':' and ',', which A1111 removes because they separate the field's entries. A second file with the same
  stem is named by its path in the loras folder, without the extension, so that no entry overwrites another in a
  reader that keys entries by name (Image Saver).
- A file listed twice (or two files with the same content) gives one entry, the first.

Files are named through `bridge.resolve`, so only files inside the configured loras folders are opened. Hashing runs
in the node, on ComfyUI's prompt worker, never on the server's event loop; work of `PROGRESS_BYTES` or more shows
ComfyUI's progress bar, and the queue's Cancel stops it between chunks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..lora_engine.hashes import autov2, default_hashes
from ..lora_engine.stack.entry import Entry, StackError, entries

from . import bridge
from .stack import CATEGORY

PROGRESS_BYTES = 64 << 20  # hashing this many bytes or more shows a progress bar
SEPARATORS = str.maketrans("", "", ":,")


def a1111_name(name: str) -> str:
    """The name A1111 gives the LoRA file `name` in its `Lora hashes` field: the file's stem, ':' and ',' removed."""
    return os.path.splitext(os.path.basename(name.replace("\\", "/")))[0].translate(SEPARATORS).strip()


def _label(name: str, taken: set[str]) -> str:
    """`a1111_name(name)`, or where another file took it, the path without the extension, else the whole name."""
    path = name.replace("\\", "/").translate(SEPARATORS).strip()
    candidates = (a1111_name(name), os.path.splitext(path)[0], path)
    return next((c for c in candidates if c and c not in taken), candidates[-1])


def counted(e: Entry, clip: bool) -> bool:
    """Whether the entry changes the image: a model strength not 0, or a clip strength not 0 where a CLIP takes it."""
    return e.strength_model != 0 or (clip and e.strength_clip != 0)


def lora_hashes(items: Iterable[Entry], clip: bool = True) -> str:
    """The `lora_hashes` text of the module's docstring for `items`; `clip`: a clip strength counts."""
    files = [(e.name, bridge.resolve("loras", e.name, show_folders=False)) for e in items if counted(e, clip)]
    out, taken, seen = [], set(), set()
    for (name, _), digest in zip(files, _digests(files)):
        if digest in seen:
            continue
        seen.add(digest)
        label = _label(name, taken)
        taken.add(label)
        out.append(f"{label}: {autov2(digest)}")
    return ", ".join(out)


def _digests(files: list[tuple[str, str]]) -> list[str]:
    """The sha256 of each file, from the cache where it holds it; one progress bar over the bytes left to hash."""
    hashes = default_hashes()
    todo = {real: _size(real) for _, real in files if hashes.cached(real) is None}
    total = sum(todo.values())
    bar = bridge.progress(total) if total >= PROGRESS_BYTES else None
    done_before = 0

    def step(done: int, _total: int) -> None:
        bridge.check_interrupt()
        if bar is not None:
            bar.update_absolute(done_before + done)

    out = []
    for name, real in files:
        out.append(hashes.sha256(real, name=name, progress=step))
        done_before += todo.pop(real, 0)
    return out


def _size(path: str) -> int:
    """The size of the file at `path` in bytes, 0 when it is gone."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # gone since it was resolved: hashing it names it in its error


class LoRAStackHashes:
    DESCRIPTION = ("The Civitai resource hashes of a stack, as A1111 writes its 'Lora hashes': 'name: hash' for "
                   "each LoRA whose strength is not 0, where hash is the AutoV2 hash (the first 10 hex digits of "
                   "the file's sha256). Feed it to Image Saver's additional_hashes so that Civitai links the image "
                   "to the LoRAs. Each file is hashed once; later runs take the hash from the cache.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("lora_hashes",)
    OUTPUT_TOOLTIPS = ("'name: hash, name: hash' for the stack's LoRAs with a strength not 0 (name: the file's "
                       "stem, hash: AutoV2, lowercase); empty for an empty stack.",)
    FUNCTION = "hashes"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"lora_stack": ("LORA_STACK", {"tooltip": "The stack to list, from LoRAStack, "
                                            "LoRAStackRows, Multi-LoRA Loader or any pack's (lora_name, "
                                            "strength_model, strength_clip) list."})}}

    @bridge.host_errors
    def hashes(self, lora_stack):
        try:
            items = entries(lora_stack)
        except StackError as e:
            raise ValueError(str(e)) from None
        return (lora_hashes(items),)
