"""The example workflows, made runnable on the synthetic models, and their stock-node references."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tools import synth

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "workflows"

# Example file names -> synthetic files in the test models folder.
NAMES = {
    "v1-5-pruned-emaonly.safetensors": synth.CHECKPOINT_NAME,
    "style.safetensors": synth.LORA_NAMES["kohya"],
    "character.safetensors": synth.LORA_NAMES["peft"],
    "detail.safetensors": synth.LORA_NAMES["locon"],
    "knight.safetensors": synth.LORA_NAMES["peft"],
    "dragon.safetensors": synth.LORA_NAMES["locon"],
}


def load(name: str) -> dict:
    return json.loads((EXAMPLES / name).read_text())


def small(prompt: dict, *, size: int = 64, steps: int = 2, cfg: float = 2.0, seed: int | None = None,
          prefix: str | None = None) -> dict:
    """Rename files to the synthetic ones, and shrink the sampling so that a CPU runs it in seconds."""
    p = copy.deepcopy(prompt)
    for node in p.values():
        node.pop("_meta", None)
        inputs = node["inputs"]
        for key in ("ckpt_name", "lora_name", "unet_name", "entry"):
            if isinstance(inputs.get(key), str):
                inputs[key] = NAMES.get(inputs[key], inputs[key])
        if node["class_type"] == "EmptyLatentImage":
            inputs.update(width=size, height=size)
        if node["class_type"] == "KSampler":
            inputs.update(steps=steps, cfg=cfg)
            if seed is not None:
                inputs["seed"] = seed
        if node["class_type"] == "SaveImage" and prefix:
            inputs["filename_prefix"] = prefix
    return p


def stack_entries(prompt: dict, loader_id: str) -> list[tuple[str, float, float, bool]]:
    """The chain of LoRAStack nodes feeding a MultiLoRALoader, first entry first."""
    out = []
    link = prompt[loader_id]["inputs"]["lora_stack"]
    while link is not None:
        node = prompt[link[0]]
        assert node["class_type"] == "LoRAStack", node["class_type"]
        i = node["inputs"]
        out.append((i["lora_name"], i["strength_model"], i["strength_clip"], i.get("enabled", True)))
        link = i.get("lora_stack")
    return out[::-1]


def to_stock(prompt: dict, loader_id: str, loader_class: str = "LoraLoader") -> dict:
    """The same graph with the stack and MultiLoRALoader replaced by a chain of stock `loader_class` nodes
    (LoraLoader, or LoraLoaderBypass: the LoRA applied at runtime, as the pack applies it)."""
    p = copy.deepcopy(prompt)
    entries = stack_entries(p, loader_id)
    loader = p.pop(loader_id)
    for nid in [k for k, v in p.items() if v["class_type"] == "LoRAStack"]:
        del p[nid]
    model, clip = loader["inputs"]["model"], loader["inputs"].get("clip")
    for j, (name, sm, sc, enabled) in enumerate(entries):
        if not enabled:
            continue
        nid = f"stock{j}"
        p[nid] = {"class_type": loader_class, "inputs": {"model": model, "clip": clip, "lora_name": name,
                                                          "strength_model": sm, "strength_clip": sc}}
        model, clip = [nid, 0], [nid, 1]
    for node in p.values():
        for k, v in node["inputs"].items():
            if isinstance(v, list) and len(v) == 2 and v[0] == loader_id:
                node["inputs"][k] = model if v[1] == 0 else clip
    return p


def set_entry(prompt: dict, entry_name: str, /, **inputs) -> dict:
    """A copy with the LoRAStack entry for `lora_name` changed."""
    p = copy.deepcopy(prompt)
    for node in p.values():
        if node["class_type"] == "LoRAStack" and node["inputs"]["lora_name"] == entry_name:
            node["inputs"].update(inputs)
            return p
    raise KeyError(entry_name)


def drop_entry(prompt: dict, lora_name: str) -> dict:
    """A copy with the LoRAStack entry for `lora_name` removed from its chain."""
    p = copy.deepcopy(prompt)
    nid = next(k for k, v in p.items() if v["class_type"] == "LoRAStack" and v["inputs"]["lora_name"] == lora_name)
    upstream = p[nid]["inputs"].get("lora_stack")
    for node in p.values():
        for k, v in list(node["inputs"].items()):
            if isinstance(v, list) and len(v) == 2 and v[0] == nid:
                if upstream is None:
                    del node["inputs"][k]
                else:
                    node["inputs"][k] = upstream
    del p[nid]
    return p


def model_graph(model_nodes: dict, model_ref, seed: int = 42, prefix: str = "model") -> dict:
    """A 64×64, 2-step image from the model at `model_ref` (built by `model_nodes`), with the synthetic
    checkpoint's text encoder and VAE."""
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a synthetic test image"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "7": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": model_ref, "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "seed": seed,
            "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    }
    p.update(model_nodes)
    return p


def loader_nodes(stack, model_ref) -> dict:
    """LoRAStack nodes s0, s1, … (model strengths only) chained into a MultiLoRALoader "ml" on `model_ref`."""
    nodes, prev = {}, None
    for j, (name, strength) in enumerate(stack):
        inputs = {"lora_name": name, "strength_model": strength, "strength_clip": 0.0}
        if prev:
            inputs["lora_stack"] = [prev, 0]
        nodes[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
        prev = f"s{j}"
    nodes["ml"] = {"class_type": "MultiLoRALoader", "inputs": {"model": model_ref, "lora_stack": [prev, 0]}}
    return nodes


def batched(prompt: dict, n: int) -> dict:
    """`prompt` (latent node "4", sampler "8") on n copies of its latent, one seed for every item: its batching
    floor against the batch-1 image."""
    p = copy.deepcopy(prompt)
    p["4"]["inputs"]["batch_size"] = n
    p["batch_seed"] = {"class_type": "LatentBatchSeedBehavior",
                       "inputs": {"samples": ["4", 0], "seed_behavior": "fixed"}}
    p["8"]["inputs"]["latent_image"] = ["batch_seed", 0]
    return p


def another_stack(prompt: dict) -> dict:
    """`prompt`, an example workflow on the synthetic files, without its detail LoRA. Run just before `prompt`, it
    makes ComfyUI run `prompt`'s loader again rather than serve its output from the cache (--cache-classic keeps
    the outputs of the last prompt only): the pack's cache then holds the stack's adapters, and the model's bank
    its slots, whatever the tests before left."""
    return drop_entry(prompt, NAMES["detail.safetensors"])
