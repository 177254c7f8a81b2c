"""The example workflows in UI format, made runnable on the synthetic models (the host tier's
`workflows.small` does the same for the API format)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tests.host.support import workflows as host_wf

SIZE, STEPS, CFG = 64, 2, 2.0

# The rows that stand for the example's three chained LoRAStack nodes.
EXAMPLE_ROWS = [
    {"enabled": True, "lora": host_wf.NAMES["style.safetensors"], "strength_model": 0.8, "strength_clip": 0.8},
    {"enabled": True, "lora": host_wf.NAMES["character.safetensors"], "strength_model": -0.4, "strength_clip": 0.5},
    {"enabled": True, "lora": host_wf.NAMES["detail.safetensors"], "strength_model": 1.3, "strength_clip": 0.0},
]


def load_ui(name: str = "multilora.json") -> dict:
    return json.loads((host_wf.EXAMPLES / name).read_text())


def small_ui(workflow: dict, prefix: str) -> dict:
    """Synthetic file names, a 64x64 latent, 2 steps at cfg 2, and a file name prefix."""
    w = copy.deepcopy(workflow)
    for node in w["nodes"]:
        values = node.get("widgets_values")
        if not values:
            continue
        values[:] = [host_wf.NAMES.get(v, v) if isinstance(v, str) else v for v in values]
        if node["type"] == "EmptyLatentImage":
            values[0:2] = [SIZE, SIZE]
        elif node["type"] == "KSampler":
            values[2:4] = [STEPS, CFG]
        elif node["type"] == "SaveImage":
            values[0] = prefix
    return w


def small_api(prefix: str) -> dict:
    return host_wf.small(host_wf.load("multilora_api.json"), size=SIZE, steps=STEPS, cfg=CFG, prefix=prefix)


def without_loras(prompt: dict) -> dict:
    """The same API prompt with every LoRAStack entry disabled: the base model's image."""
    p = copy.deepcopy(prompt)
    for node in p.values():
        if node["class_type"] == "LoRAStack":
            node["inputs"]["enabled"] = False
    return p


def rows_api(prompt: dict, rows: list[dict], single_strength: bool = False) -> dict:
    """The API prompt with its LoRAStack chain replaced by one LoRAStackRows node (the documented format)."""
    p = copy.deepcopy(prompt)
    loader = next(k for k, v in p.items() if v["class_type"] == "MultiLoRALoader")
    for k in [k for k, v in p.items() if v["class_type"] == "LoRAStack"]:
        del p[k]
    inputs = {"single_strength": single_strength}
    for i, row in enumerate(rows, 1):
        inputs.update({f"{field}_{i}": row[field] for field in ("enabled", "lora", "strength_model", "strength_clip")})
    p["rows"] = {"class_type": "LoRAStackRows", "inputs": inputs}
    p[loader]["inputs"]["lora_stack"] = ["rows", 0]
    return p


def _synthetic_names(value):
    """A value of the example with its file names, and the stems of its `<lora:…>` tags, made the synthetic ones."""
    if not isinstance(value, str):
        return value
    value = host_wf.NAMES.get(value, value)
    for example, synthetic in host_wf.NAMES.items():
        value = value.replace(f"<lora:{Path(example).stem}:", f"<lora:{Path(synthetic).stem}:")
    return value


def rows_example(prefix: str) -> tuple[dict, dict]:
    """examples/workflows/multilora_rows.json (saved before the rows were drawn one line each) and its API twin, both
    on the synthetic files and sampling as `small_ui` does."""
    ui = small_ui(load_ui("multilora_rows.json"), prefix)
    for node in ui["nodes"]:
        node["widgets_values"] = [_synthetic_names(v) for v in node.get("widgets_values") or []]
    api = host_wf.small(host_wf.load("multilora_rows_api.json"), size=SIZE, steps=STEPS, cfg=CFG, prefix=prefix)
    for node in api.values():
        node["inputs"] = {k: _synthetic_names(v) for k, v in node["inputs"].items()}
    return ui, api
