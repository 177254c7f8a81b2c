"""The Wan 2.2 pairs example (`examples/workflows/wan22_pairs_api.json`) on SD1.5 stand-ins, for the host and web tests
of MultiLoRARows' `model_low` (tests/host/test_pairs.py says why the stand-ins).

`on_sd15` keeps the example's rows, targets and two KSamplerAdvanced stages, and puts the synthetic checkpoint's
model on `model`, the same UNet through UNETLoader on `model_low` (two models that ComfyUI loads and patches each on
its own), the checkpoint's CLIP and VAE for CLIPLoader and VAELoader, a 64×64 image latent for the video latent, and
leaves out ModelSamplingSD3 (a flow shift). `make_files` writes the example's LoRA names as synthetic SD1.5 LoRAs,
model-only, each of its own content, and the names that the pairing refuses.
"""

from __future__ import annotations

import copy
import json
import subprocess

from tools import synth

from . import workflows as wf
from ..conftest import UNET_NAME, own_copy

EXAMPLE = "wan22_pairs_api.json"
ROWS = "4"
LIGHTNING_HIGH = "Wan2.2-Lightning_T2V-A14B-4steps-lora_HIGH_fp16.safetensors"
LIGHTNING_LOW = "Wan2.2-Lightning_T2V-A14B-4steps-lora_LOW_fp16.safetensors"
ANIME_HIGH, ANIME_LOW = "wan/anime_style_high_noise.safetensors", "wan/anime_style_low_noise.safetensors"
DETAIL, MOTION, MOTION_LOW = ("wan/detail_enhancer.safetensors", "wan/motion_boost.safetensors",
                              "wan/motion_boost_v2_low.safetensors")
# What the example's rows stand for, by the rules of docs/loader.md: (file, strength) per model.
HIGH = [(LIGHTNING_HIGH, 1.0), (ANIME_HIGH, 0.8), (MOTION, 0.6)]
LOW = [(LIGHTNING_LOW, 1.0), (ANIME_LOW, 0.8), (DETAIL, 0.5), (MOTION_LOW, 0.6)]
SPLIT = ("wan/one/split_high_noise.safetensors", "wan/two/split_low_noise.safetensors")
TWICE = ("wan/twice_high_HN.safetensors", "wan/twice_low_HN.safetensors", "wan/twice_high_LN.safetensors")
NAMES = [LIGHTNING_HIGH, LIGHTNING_LOW, ANIME_HIGH, ANIME_LOW, DETAIL, MOTION, MOTION_LOW, *SPLIT, *TWICE]


def make_files(loras_dir, comfy_python: str) -> dict:
    """{name: path} of `NAMES` in `loras_dir`, made once (with ComfyUI's python: torch and safetensors) and cached."""
    code = ("import json; from tools import synth; print(json.dumps([str(synth.cached_lora('kohya', seed=800 + i, "
            f"include_clip=False)) for i in range({len(NAMES)})]))")
    res = subprocess.run([comfy_python, "-c", code], cwd=wf.EXAMPLES.parents[1], capture_output=True, text=True,
                         timeout=600, check=True)
    made = {}
    for name, path in zip(NAMES, json.loads(res.stdout.strip().splitlines()[-1])):
        target = loras_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            own_copy(path, target)
        made[name] = target
    return made


def on_sd15(api: dict | None = None) -> dict:
    """The example with the SD1.5 stand-ins of the module's docstring."""
    p = copy.deepcopy(api or wf.load(EXAMPLE))
    p["1"] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}}
    p["2"]["inputs"]["unet_name"] = UNET_NAME
    del p["3"], p["5"], p["6"], p["12"]
    moved = {("3", 0): ["1", 1], ("12", 0): ["1", 2], ("5", 0): [ROWS, 0], ("6", 0): [ROWS, 5]}
    for node in p.values():
        for k, v in node["inputs"].items():
            if isinstance(v, list) and (v[0], v[1]) in moved:
                node["inputs"][k] = moved[(v[0], v[1])]
    p["9"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    p["14"] = {"class_type": "SaveImage", "inputs": {"images": ["13", 0], "filename_prefix": "wan22_pairs"}}
    return p


def with_chains(p: dict, high, low, bypass: bool = False) -> dict:
    """`p` with the rows node replaced by two stock model-only chains: `high` on model, `low` on model_low."""
    p = copy.deepcopy(p)
    kind = "LoraLoaderBypassModelOnly" if bypass else "LoraLoaderModelOnly"
    ends = {}
    for side, start, chain in (("h", ["1", 0], high), ("l", ["2", 0], low)):
        ref = start
        for j, (name, s) in enumerate(chain):
            p[f"{side}{j}"] = {"class_type": kind, "inputs": {"model": ref, "lora_name": name, "strength_model": s}}
            ref = [f"{side}{j}", 0]
        ends[side] = ref
    rows = p.pop(ROWS)
    moved = {0: ends["h"], 1: rows["inputs"]["clip"], 5: ends["l"]}
    for node in p.values():
        for k, v in node["inputs"].items():
            if isinstance(v, list) and v[0] == ROWS:
                node["inputs"][k] = moved[v[1]]
    return p
