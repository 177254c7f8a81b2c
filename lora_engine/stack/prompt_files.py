"""The files an API-format ComfyUI prompt needs: its base model files and the LoRA files of its loaders.

A worker that ran a prompt holds these (ComfyUI keeps the loaded model, the pack's cache the parsed LoRAs), so
they are what the serving application routes by (`serve/affinity.py`) and what a worker reads ahead for a prompt
queued behind another (`nodes/prefetch.py`).

Two sets, kept apart:
- `bases`: the base model files, as `<models folder>/<name>`: `checkpoints/<ckpt_name>` of CheckpointLoaderSimple
  and CheckpointLoader, `diffusion_models/<unet_name>` of UNETLoader and DistillFuse. Wan 2.2's two experts are two
  UNETLoaders (or two DistillFuses), so both are in it. The folder is kept because a checkpoint and a UNet may share
  a name and are different files.
- `loras`: the LoRA files of every loader in it, by the name the node is given:
  - our rows (`MultiLoRARows`, `LoRAStackRows`: row i is `lora_i` with `enabled_i`): a row switched off loads
    nothing; a row on at strength 0 still loads its file (it keeps its slot), so it counts. With `model_low`
    connected (Wan 2.2), a row's `lora_low_i` file counts where its `target_i` reaches the low-noise model, and
    its `lora_i` where the target reaches the high-noise one; a row whose low file is "auto" (its partner by
    name, found on the worker in its loras listing) counts by its own name, which names the same pair on every
    worker with the same loras folders;
  - `LoRAStack`'s `lora_name` when `enabled`; `LoRAStackFromJSON`'s entries (`parse_json_stack`: the enabled ones
    that reach the high-noise model, as the node's stack holds them); `DistillFuse`'s `lora_name`;
  - `LoRAStackFromPrompt`'s `<lora:…>` tags in `text`, read by `prompt_tags.find_tags`. A tag names a LoRA by
    stem or path, resolved on the worker against its files (A1111's rule); the set keeps the name as the
    resolution normalizes it before its lookup (`/` for `\\`, no outer spaces), so that the same text gives the
    same set on any machine, with or without the files;
  - stock `LoraLoader` and `LoraLoaderModelOnly` (`lora_name`), except at strength 0 (both strengths, for
    LoraLoader): ComfyUI's `LoraLoader.load_lora` then returns before it reads the file.
  "None" and blank names count as nothing.

Order and strengths are not in it: a strength change costs nothing on a worker (a tensor write into the LoRA's
slot; no file is read), and a stack in another order needs the same files. The rest of the prompt (seeds, text,
sizes) is not in it either: it costs the same on every worker.

What is not known from the prompt alone is left out: an input that is a link (`[node_id, output_index]`) rather
than a literal (a name from another node is known only when it runs; a linked `enabled_i` or `enabled` is not
read, so the row counts, as the node's default is on), and a node whose value the worker would refuse (JSON that
does not parse, a tag that does not read): the worker reports that prompt's error whatever the set. The prompt is
read as written: a loader on a branch that reaches no output node still counts, though ComfyUI does not run it.
The text encoders and VAEs are not in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .entry import StackError, is_blank, parse_json_stack
from .pairs import AUTO
from .prompt_tags import TagError, find_tags

ROWS = 64  # the rows a rows node reads: MAX_ROWS of nodes/rows.py


@dataclass(frozen=True)
class PromptFiles:
    """What a prompt needs warm on a worker: base model files as `<models folder>/<name>`, and LoRA names."""

    bases: frozenset[str] = frozenset()
    loras: frozenset[str] = frozenset()

    def __or__(self, other: PromptFiles) -> PromptFiles:
        return PromptFiles(self.bases | other.bases, self.loras | other.loras)



def _is_link(v: object) -> bool:
    return isinstance(v, list)  # ComfyUI reads every list in `inputs` as [node_id, output_index]


def _named(v: object) -> str | None:
    """A literal file name, or None for a link, a non-string, "None" or a blank."""
    return v if isinstance(v, str) and not is_blank(v) else None


def _loras(names: Iterable[str | None]) -> PromptFiles:
    return PromptFiles(loras=frozenset(n for n in names if n is not None))


def _base(folder: str, field: str) -> Callable[[Mapping[str, object]], PromptFiles]:
    def read(inputs: Mapping[str, object]) -> PromptFiles:
        name = _named(inputs.get(field))
        return PromptFiles(bases=frozenset({f"{folder}/{name}"} if name else ()))
    return read


_checkpoint = _base("checkpoints", "ckpt_name")
_unet = _base("diffusion_models", "unet_name")


def _on(v: object) -> bool:
    return v is not False  # a link is not read: the toggle's default, on


def _row_names(inputs: Mapping[str, object]) -> list[tuple[int, str]]:
    """(i, lora_i) of the rows that are on and name a LoRA."""
    return [(i, name) for i in range(1, ROWS + 1)
            if (name := _named(inputs.get(f"lora_{i}"))) and _on(inputs.get(f"enabled_{i}", True))]


def _rows(inputs: Mapping[str, object]) -> PromptFiles:
    return _loras(name for _, name in _row_names(inputs))


def _multi_rows(inputs: Mapping[str, object]) -> PromptFiles:
    if inputs.get("model_low") is None:
        return _rows(inputs)
    out = []
    for i, name in _row_names(inputs):
        target, low = inputs.get(f"target_{i}", "both"), inputs.get(f"lora_low_{i}", AUTO)
        if not _is_link(low) and (is_blank(low) or low == AUTO):
            out.append(name)  # stands for its pair, found by name on the worker
            continue
        if target != "low":
            out.append(name)
        if target != "high":
            out.append(_named(low))
    return _loras(out)


def _stack(inputs: Mapping[str, object]) -> PromptFiles:
    return _loras([_named(inputs.get("lora_name")) if _on(inputs.get("enabled", True)) else None])


def _json_stack(inputs: Mapping[str, object]) -> PromptFiles:
    text = inputs.get("stack_json")
    try:
        return _loras(e.name for e in parse_json_stack(text)) if isinstance(text, str) else PromptFiles()
    except StackError:
        return PromptFiles()


def _tag_name(name: str) -> str:
    return name.replace("\\", "/").strip()  # as prompt_tags.resolve_name normalizes a name before its lookup


def _prompt_tags(inputs: Mapping[str, object]) -> PromptFiles:
    text = inputs.get("text")
    try:
        return _loras(_tag_name(t.name) for t in find_tags(text)) if isinstance(text, str) else PromptFiles()
    except TagError:
        return PromptFiles()


def _distill(inputs: Mapping[str, object]) -> PromptFiles:
    return _unet(inputs) | _loras([_named(inputs.get("lora_name"))])


def _stock(*strengths: str) -> Callable[[Mapping[str, object]], PromptFiles]:
    def read(inputs: Mapping[str, object]) -> PromptFiles:
        if all(_is_zero(inputs.get(s)) for s in strengths):
            return PromptFiles()  # LoraLoader.load_lora returns before it reads the file
        return _loras([_named(inputs.get("lora_name"))])
    return read


def _is_zero(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


READERS: dict[str, Callable[[Mapping[str, object]], PromptFiles]] = {
    "CheckpointLoaderSimple": _checkpoint,
    "CheckpointLoader": _checkpoint,
    "UNETLoader": _unet,
    "DistillFuse": _distill,
    "MultiLoRARows": _multi_rows,
    "LoRAStackRows": _rows,
    "LoRAStack": _stack,
    "LoRAStackFromJSON": _json_stack,
    "LoRAStackFromPrompt": _prompt_tags,
    "LoraLoader": _stock("strength_model", "strength_clip"),
    "LoraLoaderModelOnly": _stock("strength_model"),
}


def prompt_files(prompt: Mapping[str, object]) -> PromptFiles:
    """The files `prompt` (API format: `{node_id: {"class_type", "inputs"}}`, the `prompt` of a `POST /prompt`
    body) needs warm. A node of another class, or one that is not `{"class_type", "inputs"}`, adds nothing."""
    if not isinstance(prompt, Mapping):
        raise TypeError(f"an API-format prompt is a JSON object {{node_id: {{\"class_type\", \"inputs\"}}}}, got "
                        f"{type(prompt).__name__}; pass the \"prompt\" field of a POST /prompt body")
    out = PromptFiles()
    for node in prompt.values():
        if not isinstance(node, Mapping) or not isinstance(inputs := node.get("inputs"), Mapping):
            continue
        cls = node.get("class_type")
        if isinstance(cls, str) and (read := READERS.get(cls)) is not None:
            out |= read(inputs)
    return out
