"""The files a prompt needs (lora_engine/stack/prompt_files.py) and its affinity key (serve/affinity.py), without
order or strengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lora_engine.stack.prompt_files import PromptFiles, prompt_files
from serve.affinity import KEY_CHARS, affinity_key, key

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "examples" / "workflows"
SD15 = "checkpoints/v1-5-pruned-emaonly.safetensors"
WAN_HIGH = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"
WAN_LOW = "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"
LIGHTNING = "Wan2.2-Lightning_T2V-A14B-4steps-lora_HIGH_fp16.safetensors"
LINK = ["9", 0]


def prompt(*nodes: tuple[str, dict]) -> dict:
    """An API-format prompt of `(class_type, inputs)` nodes, with ids "1", "2", ..."""
    return {str(i): {"class_type": c, "inputs": inputs} for i, (c, inputs) in enumerate(nodes, 1)}


def ckpt(name: str = "sd15.safetensors") -> tuple[str, dict]:
    return "CheckpointLoaderSimple", {"ckpt_name": name}


def rows(*names: str, cls: str = "MultiLoRARows", **inputs) -> tuple[str, dict]:
    """A rows node with row i naming names[i-1], on, at strength 1."""
    out = {"model": ["1", 0], "clip": ["1", 1], "max_loras": 0}
    for i, n in enumerate(names, 1):
        out.update({f"enabled_{i}": True, f"lora_{i}": n, f"strength_model_{i}": 1.0, f"strength_clip_{i}": 1.0})
    return cls, {**out, **inputs}


def stack(name: str, **inputs) -> tuple[str, dict]:
    return "LoRAStack", {"lora_name": name, "strength_model": 1.0, "strength_clip": 1.0, "enabled": True, **inputs}


def stock(name: str, sm: object = 1.0, sc: object = 1.0) -> tuple[str, dict]:
    return "LoraLoader", {"model": ["1", 0], "clip": ["1", 1], "lora_name": name, "strength_model": sm,
                          "strength_clip": sc}


def from_json(doc: object) -> tuple[str, dict]:
    return "LoRAStackFromJSON", {"stack_json": doc if isinstance(doc, str) else json.dumps(doc)}


def tags(text: object) -> tuple[str, dict]:
    return "LoRAStackFromPrompt", {"text": text}


def wan(*row_nodes: tuple[str, dict]) -> dict:
    return prompt(("UNETLoader", {"unet_name": WAN_HIGH, "weight_dtype": "default"}),
                  ("UNETLoader", {"unet_name": WAN_LOW, "weight_dtype": "default"}), *row_nodes)


def wan_row(name: str, target: object = "both", low: object = "auto", **inputs) -> tuple[str, dict]:
    return rows(name, model_low=["2", 0], target_1=target, lora_low_1=low, **inputs)


# Every example workflow, and the exact sets its key is made of: the files it names.
EXAMPLES = {
    "auto_regions_api.json": ({SD15}, {"knight.safetensors", "dragon.safetensors"}),
    "composite_api.json": ({SD15}, {"knight.safetensors", "dragon.safetensors"}),
    "lora_grid_api.json": ({SD15}, {"style.safetensors", "detail.safetensors"}),
    "masked_api.json": ({SD15}, {"knight.safetensors", "dragon.safetensors"}),
    "multilora_api.json": ({SD15}, {"style.safetensors", "character.safetensors", "detail.safetensors"}),
    # the rows and a prompt tag, kept by its name as written: the worker resolves it
    "multilora_rows_api.json": ({SD15}, {"style.safetensors", "detail.safetensors", "character"}),
    "regional_api.json": ({SD15}, {"style.safetensors", "character.safetensors", "detail.safetensors"}),
    "shaping_api.json": ({SD15}, {"character.safetensors", "detail.safetensors"}),
    "switch_api.json": ({SD15}, {"knight.safetensors", "dragon.safetensors", "style.safetensors"}),
    "wan22_distill_api.json": (
        {"diffusion_models/wan2.2_t2v_high_noise_14B_fp16.safetensors",
         "diffusion_models/wan2.2_t2v_low_noise_14B_fp16.safetensors"},
        {LIGHTNING, "Wan2.2-Lightning_T2V-A14B-4steps-lora_LOW_fp16.safetensors"}),
    # both experts; auto rows by their own name (the partner is found on the worker), row 3 targets the low model
    # with no partner (its own file), row 4 names its low file
    "wan22_pairs_api.json": (
        {f"diffusion_models/{WAN_HIGH}", f"diffusion_models/{WAN_LOW}"},
        {LIGHTNING, "wan/anime_style_high_noise.safetensors", "wan/detail_enhancer.safetensors",
         "wan/motion_boost.safetensors", "wan/motion_boost_v2_low.safetensors"}),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in WORKFLOWS.glob("*_api.json")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_workflow(name):
    p = json.loads((WORKFLOWS / name).read_text(encoding="utf-8"))
    bases, loras = EXAMPLES[name]
    assert prompt_files(p) == PromptFiles(frozenset(bases), frozenset(loras))
    assert affinity_key(p) == key(PromptFiles(frozenset(bases), frozenset(loras)))


# (case, prompt, bases, loras): the exact sets a prompt's key is made of.
CASES = [
    ("rows", prompt(ckpt(), rows("a.safetensors", "sub/b.safetensors")),
     {"checkpoints/sd15.safetensors"}, {"a.safetensors", "sub/b.safetensors"}),
    ("row off loads nothing", prompt(rows("a.safetensors", "b.safetensors", enabled_2=False)),
     set(), {"a.safetensors"}),
    ("row on at strength 0 counts", prompt(rows("a.safetensors", strength_model_1=0.0, strength_clip_1=0.0)),
     set(), {"a.safetensors"}),
    ("None and blank rows are nothing", prompt(rows("None", "", "  ", "a.safetensors")), set(), {"a.safetensors"}),
    ("rows may skip numbers", prompt(("LoRAStackRows", {"lora_2": "a.safetensors", "lora_64": "b.safetensors",
                                                        "lora_65": "beyond.safetensors"})),
     set(), {"a.safetensors", "b.safetensors"}),
    ("a linked name is left out", prompt(rows("a.safetensors"), rows(cls="LoRAStackRows", lora_1=LINK)),
     set(), {"a.safetensors"}),
    ("a linked toggle is not read: the row counts", prompt(rows("a.safetensors", enabled_1=LINK)),
     set(), {"a.safetensors"}),
    ("LoRAStackRows", prompt(rows("a.safetensors", "b.safetensors", cls="LoRAStackRows", enabled_1=False)),
     set(), {"b.safetensors"}),
    ("LoRAStack chain", prompt(stack("a.safetensors"), stack("b.safetensors", enabled=False),
                               stack("c.safetensors", strength_model=0.0, strength_clip=0.0),
                               ("LoRAStack", {"lora_name": "d.safetensors"}), stack("None"), stack(LINK)),
     set(), {"a.safetensors", "c.safetensors", "d.safetensors"}),
    ("JSON stack", prompt(from_json([{"name": "a.safetensors", "strength_model": 0.5},
                                     {"name": "b.safetensors", "enabled": False},
                                     {"name": "c.safetensors", "target": "low"},
                                     {"name": "d.safetensors", "lora_low": "d_low.safetensors"}])),
     set(), {"a.safetensors", "d.safetensors"}),
    ("JSON stack of one object", prompt(from_json({"name": "a.safetensors"})), set(), {"a.safetensors"}),
    ("JSON that does not parse adds nothing", prompt(from_json("[{"), stack("a.safetensors")),
     set(), {"a.safetensors"}),
    ("a linked JSON stack is left out", prompt(from_json(LINK)), set(), set()),
    ("prompt tags", prompt(tags("a fox, <lora:style:0.8> <LyCO: sub\\detail :0.2:1> <lora:1:1 look>, "
                                "<lora:char.safetensors:te=0.5>")),
     set(), {"style", "sub/detail", "1:1 look", "char.safetensors"}),
    ("a tag that does not read adds nothing", prompt(tags("<lora:a:1:2:3>"), stack("b.safetensors")),
     set(), {"b.safetensors"}),
    ("a linked text is left out", prompt(tags(LINK)), set(), set()),
    ("stock LoraLoader chain", prompt(ckpt(), stock("a.safetensors"), stock("b.safetensors", 0.0, 0.7),
                                      ("LoraLoaderModelOnly", {"model": ["2", 0], "lora_name": "c.safetensors",
                                                               "strength_model": -0.5})),
     {"checkpoints/sd15.safetensors"}, {"a.safetensors", "b.safetensors", "c.safetensors"}),
    # ComfyUI's LoraLoader returns before it reads the file when both strengths are 0
    ("stock loader at strength 0 reads nothing", prompt(stock("a.safetensors", 0.0, 0), stock("b.safetensors", LINK, 0),
                                                        ("LoraLoaderModelOnly", {"lora_name": "c.safetensors",
                                                                                 "strength_model": 0.0})),
     set(), {"b.safetensors"}),
    ("CheckpointLoader", prompt(("CheckpointLoader", {"config_name": "v1.yaml", "ckpt_name": "x/sd.ckpt"})),
     {"checkpoints/x/sd.ckpt"}, set()),
    ("a checkpoint and a UNet of one name are two files",
     prompt(ckpt("m.safetensors"), ("UNETLoader", {"unet_name": "m.safetensors", "weight_dtype": "fp8_e4m3fn"})),
     {"checkpoints/m.safetensors", "diffusion_models/m.safetensors"}, set()),
    ("a linked checkpoint is left out", prompt(ckpt(LINK)), set(), set()),
    ("DistillFuse", prompt(("DistillFuse", {"unet_name": "u.safetensors", "weight_dtype": "default",
                                            "lora_name": "lightning.safetensors", "strength": 1.0})),
     {"diffusion_models/u.safetensors"}, {"lightning.safetensors"}),
    ("Wan 2.2: an auto row is keyed by its own name", wan(wan_row("s_high_noise.safetensors")),
     {f"diffusion_models/{WAN_HIGH}", f"diffusion_models/{WAN_LOW}"}, {"s_high_noise.safetensors"}),
    ("Wan 2.2: a named low file, both models", wan(wan_row("h.safetensors", "both", "l.safetensors")),
     {f"diffusion_models/{WAN_HIGH}", f"diffusion_models/{WAN_LOW}"}, {"h.safetensors", "l.safetensors"}),
    ("Wan 2.2: a named low file, high model only", wan(wan_row("h.safetensors", "high", "l.safetensors")),
     {f"diffusion_models/{WAN_HIGH}", f"diffusion_models/{WAN_LOW}"}, {"h.safetensors"}),
    ("Wan 2.2: a named low file, low model only", wan(wan_row("h.safetensors", "low", "l.safetensors")),
     {f"diffusion_models/{WAN_HIGH}", f"diffusion_models/{WAN_LOW}"}, {"l.safetensors"}),
    ("Wan 2.2: a linked low file is left out", wan(wan_row("h.safetensors", "both", LINK)),
     {f"diffusion_models/{WAN_HIGH}", f"diffusion_models/{WAN_LOW}"}, {"h.safetensors"}),
    ("without model_low, lora_low is not read", prompt(rows("h.safetensors", target_1="low",
                                                            lora_low_1="l.safetensors")),
     set(), {"h.safetensors"}),
    ("other nodes and malformed entries add nothing",
     {"1": {"class_type": "KSampler", "inputs": {"lora_name": "x.safetensors"}}, "2": "junk",
      "3": {"class_type": "LoRAStack"}, "4": {"inputs": {"lora_name": "y.safetensors"}},
      "5": {"class_type": ["LoRAStack"], "inputs": {"lora_name": "z.safetensors"}}},
     set(), set()),
]


@pytest.mark.parametrize(("case", "p", "bases", "loras"), CASES, ids=[c[0] for c in CASES])
def test_sets(case, p, bases, loras):
    assert prompt_files(p) == PromptFiles(frozenset(bases), frozenset(loras))


def _swapped_rows(p: dict) -> dict:
    inputs = dict(p["2"]["inputs"])
    for field in ("enabled", "lora", "strength_model", "strength_clip"):
        inputs[f"{field}_1"], inputs[f"{field}_2"] = inputs[f"{field}_2"], inputs[f"{field}_1"]
    return {**p, "2": {**p["2"], "inputs": inputs}}


BASE = prompt(ckpt(), rows("a.safetensors", "b.safetensors"))
JSON_AB = [{"name": "a.safetensors", "strength_model": 0.5}, {"name": "b.safetensors"}]

# (case, prompt, another prompt, whether their keys are equal)
KEYS = [
    ("rows in another order", BASE, _swapped_rows(BASE), True),
    ("nodes in another order", BASE, dict(reversed(list(BASE.items()))), True),
    ("other strengths", BASE, prompt(ckpt(), rows("a.safetensors", "b.safetensors", strength_model_1=-2.0,
                                                  strength_clip_2=0.0)), True),
    ("a LoRA named twice", BASE, prompt(ckpt(), rows("a.safetensors", "b.safetensors", "a.safetensors")), True),
    ("the same files through other nodes", BASE, prompt(ckpt(), stack("b.safetensors"), stock("a.safetensors", 0.3)),
     True),
    ("other seeds, texts and sizes", prompt(ckpt(), ("KSampler", {"seed": 1})),
     prompt(ckpt(), ("KSampler", {"seed": 2}), ("CLIPTextEncode", {"text": "a fox"})), True),
    ("JSON entries in another order, strengths, spacing", prompt(from_json(JSON_AB)),
     prompt(from_json(json.dumps(JSON_AB[::-1], indent=4).replace('"name"', '"strength_clip": 2, "name"'))), True),
    ("tags in another order, at other weights", prompt(tags("<lora:a:0.5> x <lora:b>")),
     prompt(tags("y <lora:b:1.5:0>, <lora: a >")), True),
    ("a row switched off", BASE, prompt(ckpt(), rows("a.safetensors", "b.safetensors", enabled_2=False)), False),
    ("a LoRA added", BASE, prompt(ckpt(), rows("a.safetensors", "b.safetensors"), stack("c.safetensors")), False),
    ("another checkpoint", BASE, prompt(ckpt("sdxl.safetensors"), rows("a.safetensors", "b.safetensors")), False),
    ("a tag added", prompt(tags("<lora:a>")), prompt(tags("<lora:a> <lora:b>")), False),
    ("a stock loader moved off 0", prompt(stock("a.safetensors", 0.0, 0.0)), prompt(stock("a.safetensors", 0.1, 0.0)),
     False),
    ("a tag by stem and the file by name", prompt(tags("<lora:a>")), prompt(stack("a.safetensors")), False),
]


@pytest.mark.parametrize(("case", "one", "other", "same"), KEYS, ids=[c[0] for c in KEYS])
def test_key(case, one, other, same):
    assert (affinity_key(one) == affinity_key(other)) is same


@pytest.mark.parametrize(("one", "other"), [
    (PromptFiles(bases=frozenset({"a"})), PromptFiles(loras=frozenset({"a"}))),  # bases and LoRAs kept apart
    (PromptFiles(loras=frozenset({"a,b"})), PromptFiles(loras=frozenset({"a", "b"}))),  # names never run together
    (PromptFiles(loras=frozenset({"a"})), PromptFiles(loras=frozenset({"a "}))),
])
def test_sets_never_collide(one, other):
    assert key(one) != key(other)


def test_key_is_short_hex_and_pinned():
    p = json.loads((WORKFLOWS / "multilora_api.json").read_text(encoding="utf-8"))
    k = affinity_key(p)
    assert len(k) == KEY_CHARS == 16 and int(k, 16) >= 0
    # The key of a prompt never changes between releases unless its definition does: a router and its workers may
    # run different processes and versions.
    assert k == "9f0e6cd0df62075b"
    assert affinity_key({}) == key(PromptFiles()) == "73634d491714e286"


def test_key_is_the_same_in_another_process_without_comfy():
    """Another process, with another string hash seed, gives the same key, having imported neither ComfyUI nor the
    pack's nodes."""
    code = textwrap.dedent("""
        import json, sys
        from serve.affinity import affinity_key
        host = [m for m in sys.modules if m.split('.')[0] in ('comfy', 'comfy_api', 'folder_paths', 'nodes', 'server')]
        assert not host, host
        print(affinity_key(json.load(open(sys.argv[1], encoding='utf-8'))))
    """)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(WORKFLOWS / "wan22_pairs_api.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == affinity_key(json.loads((WORKFLOWS / "wan22_pairs_api.json").read_text()))


def test_not_a_prompt():
    with pytest.raises(TypeError, match=r"got list; pass the \"prompt\" field"):
        prompt_files([])  # type: ignore[arg-type]
