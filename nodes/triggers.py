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
Of the LoRA itself only the header's metadata is used, never a tensor: MultiLoRARows takes it from the adapters its
stack loaded (the file is not read again), the picker's listing from a header read (`library`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping

from ..lora_engine import Adapter, LoRAError
from ..lora_engine.stack.lora_info import MAX_TRIGGERS, tag_counts
from . import bridge

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


def _read_json(path: str) -> tuple[object, str | None]:
    """(the parsed JSON of a sidecar file, None) or (None, why it could not be read); (None, None) when there is none."""
    try:
        if not os.path.isfile(path):
            return None, None
        if os.path.getsize(path) > MAX_SIDECAR:
            return None, f"larger than {MAX_SIDECAR >> 20} MiB"
        with open(path, encoding="utf-8") as f:
            return json.load(f), None
    except OSError as e:  # unreadable
        return None, e.strerror or type(e).__name__
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past the stack
        return None, f"not valid JSON ({type(e).__name__})"


def _weight(doc: Mapping) -> float | None:
    """The preferred weight a sidecar gives: A1111's `"preferred weight"` (0: none), LoRA Manager's `usage_tips`
    (a JSON string with `strength`)."""
    value = doc.get("preferred weight")
    if value in (None, 0, "0", ""):
        tips = doc.get("usage_tips")
        try:
            value = json.loads(tips).get("strength") if isinstance(tips, str) else None
        except (ValueError, AttributeError, RecursionError):
            value = None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) < 1e6 and value != 0 else None


def read_sidecars(path: str, allowed: Callable[[int], bool] | None = None) -> dict:
    """What the sidecar files beside the LoRA file at `path` say: {"words": trigger words, "weight": preferred
    weight or None, "unreadable": ["name.json: not valid JSON (JSONDecodeError)", ...]} (file names without folders).
    `allowed(i)` False: the i-th sidecar of SIDECARS is not opened (it links out of the loras folders)."""
    words: list[str] = []
    weight = None
    unreadable = []
    for i, (file, (_, reader)) in enumerate(zip(sidecar_paths(path), SIDECARS)):
        if allowed is not None and not allowed(i):
            unreadable.append(f"{os.path.basename(file)}: links outside the loras folders, not read")
            continue
        doc, error = _read_json(file)
        if error:
            unreadable.append(f"{os.path.basename(file)}: {error}")
        if isinstance(doc, Mapping):
            words += reader(doc)
            weight = weight if weight is not None else _weight(doc)
    return {"words": words, "weight": weight, "unreadable": unreadable}


def sidecar_words(path: str) -> list[str]:
    """The trigger words that the sidecar files beside the LoRA file at `path` name."""
    return read_sidecars(path)["words"]


def most_frequent_tags(raw: str | None) -> list[str]:
    """The tags of an `ss_tag_frequency` value ({dataset: {tag: count}}) with the highest count, in file order."""
    counts = tag_counts(raw)
    top = max(counts.values(), default=0)
    return [tag for tag, n in counts.items() if n == top and top > 0][:MAX_TRIGGERS]


def metadata_words(metadata: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the words of `modelspec.trigger_phrase`, the most frequent tags of `ss_tag_frequency`)."""
    return _words(metadata.get("modelspec.trigger_phrase", "")), most_frequent_tags(metadata.get("ss_tag_frequency"))


def trigger_words(metadata: Mapping[str, str], sidecar: list[str]) -> list[str]:
    """The trigger words of a LoRA from its header's metadata and its sidecars' words (the module docstring's order)."""
    phrase, tags = metadata_words(metadata)
    return unique(sidecar + phrase or tags)


def unique(words: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for w in words:
        seen.setdefault(w, None)
    return list(seen)


def trigger_text(adapters: Iterable[Adapter]) -> str:
    """The trigger words of the LoRAs loaded as `adapters`, comma-joined, each word once: from the header metadata
    the adapter holds (the file is not read again) and the sidecars beside it."""
    words = []
    for adapter in unique(adapters):
        words += trigger_words(adapter.metadata, sidecar_words(adapter.path))
    return ", ".join(unique(words))


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
