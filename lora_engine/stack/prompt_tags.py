"""A1111's `<lora:…>` prompt syntax: the tags in a text, the text without them, and a tag's name resolved to a file.

Pure standard library, so that it can be tested without ComfyUI.

A tag is `<lora:NAME>` (strength 1.0), `<lora:NAME:W>` (model and text encoder at W) or `<lora:NAME:W_MODEL:W_CLIP>`;
`<lyco:…>` is the same. A strength may also be given by key, as A1111 allows: `unet=W` (the model) and `te=W` (the text
encoder). A NAME may hold colons ("1:1 style"): the numbers are read from the end.

A NAME resolves as A1111 resolves it: by the file's path relative to a loras folder or by its file name alone, each with
or without the extension, in any subfolder. A path wins over a bare file name; a bare name that two files carry is an
error that names both.
"""

from __future__ import annotations

import difflib
import re
from typing import NamedTuple

TAG = re.compile(r"<(lora|lyco):([^<>]*)>", re.IGNORECASE)
NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")
KEYS = {"unet": "model", "te": "clip"}
EXTENSIONS = (".safetensors", ".pt", ".pth", ".ckpt", ".bin", ".sft")


class TagError(ValueError):
    """A tag that cannot be read or whose name resolves to no file or to several."""


class Tag(NamedTuple):
    text: str  # the tag as written
    name: str
    strength_model: float
    strength_clip: float


def _number(tag: str, v: str) -> float:
    if not NUMBER.match(v):
        raise TagError(f"{tag}: {v.strip()!r} is not a strength; write <lora:name:0.8> or <lora:name:0.8:0.5>")
    return float(v)


def parse_tag(tag: str, body: str) -> Tag:
    """The name and strengths of one tag, from its text between `<lora:` and `>`."""
    parts = body.split(":")
    positional: list[str] = []
    named: dict[str, str] = {}
    # Strengths are read from the end; the rest is the name.
    while len(parts) > 1:
        last = parts[-1]
        key, eq, value = last.partition("=")
        if eq and key.strip().lower() in KEYS:
            named[KEYS[key.strip().lower()]] = value
        elif NUMBER.match(last):
            if len(positional) + len(named) >= 2:
                raise TagError(f"{tag}: too many strengths; write <lora:name:model_strength:clip_strength>")
            positional.insert(0, last)
        else:
            break
        parts.pop()
    name = ":".join(parts).strip()
    if not name:
        raise TagError(f"{tag}: the tag names no LoRA")
    if len(positional) > 2 - len(named):
        raise TagError(f"{tag}: too many strengths; write <lora:name:model_strength:clip_strength>")
    sm = _number(tag, named["model"]) if "model" in named else _number(tag, positional.pop(0)) if positional else 1.0
    sc = _number(tag, named["clip"]) if "clip" in named else _number(tag, positional.pop(0)) if positional else sm
    return Tag(tag, name, sm, sc)


def find_tags(text: str) -> list[Tag]:
    return [parse_tag(m.group(0), m.group(2)) for m in TAG.finditer(text)]


def strip_tags(text: str) -> str:
    """`text` without its tags: no doubled spaces or commas, no space before a comma, no comma opening a line and no
    empty line left by a tag. A comma that ends a line is the prompt's own and stays."""
    lines = []
    for line in TAG.sub(" ", text).splitlines():
        had_text = bool(line.strip())
        line = re.sub(r"[ \t]+", " ", line)
        line = re.sub(r"\s+,", ",", line)
        line = re.sub(r",(\s*,)+", ",", line)
        line = line.strip().lstrip(",").strip()
        if line or not had_text:
            lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _stem(path: str) -> str:
    low = path.lower()
    for ext in EXTENSIONS:
        if low.endswith(ext):
            return path[: -len(ext)]
    return path


def resolve_name(name: str, files: list[str], tag: str = "") -> str:
    """The one file of `files` (paths relative to the loras folders) that `name` stands for."""
    want = name.replace("\\", "/").strip()
    paths = {f: f.replace("\\", "/") for f in files}
    for match in (lambda p: p == want, lambda p: _stem(p) == want,
                  lambda p: p.rsplit("/", 1)[-1] == want, lambda p: _stem(p.rsplit("/", 1)[-1]) == want):
        found = [f for f, p in paths.items() if match(p)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            listed = ", ".join(sorted(found))
            raise TagError(f"{tag or name}: {name!r} matches {len(found)} files: {listed}; write the one you mean with "
                           "its folder, as <lora:folder/name:1.0>")
    stems: dict[str, list[str]] = {}
    for f, p in paths.items():
        stems.setdefault(_stem(p.rsplit("/", 1)[-1]), []).append(f)
    close = difflib.get_close_matches(_stem(want.rsplit("/", 1)[-1]), list(stems), n=5, cutoff=0.4)
    listed = ", ".join(f for c in close for f in sorted(stems[c]))
    hint = f"closest names: {listed}" if close else "the loras folders hold no similar name"
    raise TagError(f"{tag or name}: no LoRA named {name!r} in the loras folders; {hint}")
