"""Trigger words of a LoRA, as a prompt can use them: from its safetensors header and its sidecar files.

Sources, in this order, every word once:

1. the sidecar files that other tools write beside `name.safetensors`:
   - `name.json`: A1111/Forge's user metadata for a LoRA (`"activation text"`);
   - `name.metadata.json`: LoRA Manager's (`civitai.trainedWords`);
   - `name.civitai.info`: Civitai Helper's (`trainedWords`);
2. the header's `modelspec.trigger_phrase`;
3. only when 1 and 2 gave nothing: the tags of kohya's `ss_tag_frequency` that the most captions carry (the
   trigger word of a kohya training is in every caption), at most `MAX_TRIGGERS`.

A sidecar that is missing, too large or not JSON adds nothing: it is a convenience file, not part of the LoRA.
Only the header is read from the LoRA itself, never its tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

from ..lora_engine import LoRAError, read_header
from . import bridge
from .lora_info import MAX_TRIGGERS, tag_counts

MAX_SIDECAR = 4 << 20  # bytes; Civitai's .info files are a few KB


def _words(value: object) -> list[str]:
    """The comma-separated words of a string, or of each string in a list."""
    items = value if isinstance(value, list) else [value]
    return [w.strip() for item in items if isinstance(item, str) for w in item.split(",") if w.strip()]


def _a1111(doc: Mapping) -> list[str]:
    return _words(doc.get("activation text"))


def _lora_manager(doc: Mapping) -> list[str]:
    civitai = doc.get("civitai")
    return _words(civitai.get("trainedWords")) if isinstance(civitai, Mapping) else []


def _civitai_helper(doc: Mapping) -> list[str]:
    return _words(doc.get("trainedWords"))


# (suffix replacing the LoRA's extension, reader of the parsed JSON)
SIDECARS = ((".json", _a1111), (".metadata.json", _lora_manager), (".civitai.info", _civitai_helper))


def sidecar_paths(path: str) -> list[str]:
    stem = os.path.splitext(path)[0]
    return [stem + suffix for suffix, _ in SIDECARS]


def _read_json(path: str) -> object:
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_SIDECAR:
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON, nested past the stack
        return None


def sidecar_words(path: str) -> list[str]:
    """The trigger words that the sidecar files beside the LoRA file at `path` name."""
    out = []
    for file, (_, reader) in zip(sidecar_paths(path), SIDECARS):
        doc = _read_json(file)
        if isinstance(doc, Mapping):
            out += reader(doc)
    return out


def most_frequent_tags(raw: str | None) -> list[str]:
    """The tags of an `ss_tag_frequency` value ({dataset: {tag: count}}) with the highest count, in file order."""
    counts = tag_counts(raw)
    top = max(counts.values(), default=0)
    return [tag for tag, n in counts.items() if n == top and top > 0][:MAX_TRIGGERS]


def metadata_words(metadata: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the words of `modelspec.trigger_phrase`, the most frequent tags of `ss_tag_frequency`)."""
    return _words(metadata.get("modelspec.trigger_phrase", "")), most_frequent_tags(metadata.get("ss_tag_frequency"))


def lora_trigger_words(name: str) -> list[str]:
    """The trigger words of one LoRA in the loras folders (see the module's docstring for the order)."""
    path = bridge.resolve("loras", name)
    try:
        metadata = read_header(path).metadata
    except LoRAError:  # not a safetensors file (.pt, .ckpt): its sidecars alone
        metadata = {}
    phrase, tags = metadata_words(metadata)
    words = sidecar_words(path) + phrase
    return unique(words or tags)


def unique(words: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for w in words:
        seen.setdefault(w, None)
    return list(seen)


def trigger_text(names: Iterable[str]) -> str:
    """The trigger words of every LoRA named, comma-joined, each word once."""
    return ", ".join(unique(w for name in unique(names) for w in lora_trigger_words(name)))


def sidecar_state(names: Iterable[object]) -> str:
    """Size and modification time of each sidecar file of the LoRAs named: a part of IS_CHANGED, so that an edited
    sidecar gives new trigger words at the next run."""
    state = []
    for name in names:
        try:
            path = bridge.resolve("loras", name)
        except LoRAError:
            continue  # file_state reports it
        for file in sidecar_paths(path):
            try:
                st = os.stat(file)
                state.append(f"{file}:{st.st_size}:{st.st_mtime_ns}")
            except OSError:
                pass
    return "\n".join(state)
