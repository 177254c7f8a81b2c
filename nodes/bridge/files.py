"""Files in ComfyUI's configured folders, and the adapters read from them.

A name that arrives through a node or the API is opened only when it resolves, links followed, to a regular
file inside one of the folder's configured directories.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

import comfy.lora_convert
import comfy.model_management
import comfy.utils
import folder_paths

from ...lora_engine import Adapter, LoRAFileError, default_cache
from ...lora_engine.cache import Preload

MAX_NAME = 1024


def lora_names() -> list[str]:
    return folder_paths.get_filename_list("loras")


def folder_roots(folder: str) -> list[str]:
    """The configured directories of `folder`, in ComfyUI's order of lookup."""
    return list(folder_paths.get_folder_paths(folder))


def filenames(folder: str) -> list[str]:
    return folder_paths.get_filename_list(folder)


def resolve(folder: str, name: object, *, show_folders: bool = True) -> str:
    """The real path of `name` inside one of `folder`'s configured directories, or a `LoRAFileError`, which names
    the directories searched unless `show_folders` is False. Nothing is opened before the checks pass."""
    check_relative(name, folder)
    roots = [os.path.realpath(d) for d in folder_paths.get_folder_paths(folder)]
    other = False  # the name is there, but not as a regular file
    for d in folder_paths.get_folder_paths(folder):
        candidate = os.path.join(d, name)
        if not os.path.isfile(candidate):
            other = other or os.path.lexists(candidate)
            continue
        real = os.path.realpath(candidate)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            raise LoRAFileError(f"{name!r} resolves outside the configured {folder} folders (a symlink escapes)",
                                path=name, remedy=f"place the file inside a {folder} folder")
        return real
    searched = f" ({', '.join(roots)})" if show_folders else ""
    if other:
        raise LoRAFileError(f"{name!r} in the {folder} folders{searched} is not a regular file (a directory, a FIFO "
                            "or a device, or a symlink to one of these, to nowhere or in a loop)", path=name,
                            remedy="put the .safetensors file itself there")
    raise LoRAFileError(f"no file named {name!r} in the {folder} folders{searched}", path=name,
                        remedy="check the name, or refresh the node list after adding the file")


def check_relative(name: object, folder: str) -> None:
    """Raise unless `name` can only name a file under one of `folder`'s directories: a non-empty string of at most
    MAX_NAME characters, without a NUL byte, not absolute (nor, on Windows, on a drive or a UNC path), without
    '..'. On other systems a colon is an ordinary character of a file name ("1:1 style.safetensors")."""
    if not isinstance(name, str) or not name.strip():
        raise LoRAFileError(f"expected a file name in the {folder} folder, got {name!r}")
    if "\x00" in name or len(name) > MAX_NAME:
        raise LoRAFileError(f"refused {folder} name (NUL byte or longer than {MAX_NAME} characters)",
                            path=name[:80])
    if os.path.isabs(name) or name.startswith(("\\", "/")) or os.path.splitdrive(name)[0]:  # a drive: Windows
        raise LoRAFileError(f"absolute paths are refused; use a name relative to the {folder} folder", path=name)
    if ".." in name.replace("\\", "/").split("/"):
        raise LoRAFileError(f"'..' is refused in {folder} names", path=name)


def file_state(folder: str, names: Sequence[object]) -> str:
    """What IS_CHANGED returns for a node that names files: each one's size, modification time, inode and
    status-change time (the file identity of the engine's cache), so that a file replaced on disk runs the
    node, and every node after it, again (ComfyUI otherwise serves their cached outputs, and the new file is
    read at the next change of an input). Stats only, never reads; a name that does not resolve gives its
    error, which validation or the run reports."""
    state = []
    for name in names:
        try:
            st = os.stat(resolve(folder, name))
            state.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}")
        except (LoRAFileError, OSError) as e:
            state.append(f"{name}:{e}")
    return "\n".join(state)


def _convert(sd):
    return comfy.lora_convert.convert_lora(sd)


def load_lora(name: str) -> Adapter:
    """The parsed adapter for a name in the loras folders, from the process-wide cache."""
    adapter = default_cache().load(resolve("loras", name), name=name, convert=_convert, convert_id="comfy")
    return adapter


def preload_lora(name: str, protected: Collection[str]) -> Preload:
    """Read a name in the loras folders into the process-wide cache ahead of the prompt that names it, as `load_lora`
    reads it (so that its load then finds it), kept only where that evicts none of the `protected` paths
    (`AdapterCache.preload`). Raises the `LoRAFileError` or `LoRAFormatError` that `load_lora` would."""
    return default_cache().preload(resolve("loras", name), protected=protected, name=name, convert=_convert,
                                   convert_id="comfy")


def load_loras(names: Sequence[str]) -> list[Adapter]:
    """The adapters of a stack's entries, one object per file: an entry naming a file an earlier entry named
    (under the same name or through a link) gets that entry's adapter, even where the cache has dropped it
    in between, so that the engine's rules for a LoRA listed twice see one LoRA."""
    pbar = comfy.utils.ProgressBar(len(names)) if names else None
    out, by_file = [], {}
    for i, name in enumerate(names):
        comfy.model_management.throw_exception_if_processing_interrupted()
        file = os.path.realpath(resolve("loras", name))
        if file not in by_file:
            by_file[file] = load_lora(name)
        out.append(by_file[file])
        pbar.update_absolute(i + 1)
    return out
