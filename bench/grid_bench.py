"""A 4×4 LoRA strength grid: one batch (LoRAStrengthGrid) against 16 sequential runs, with stock
LoraLoader chains and with our MultiLoRALoader, on one real ComfyUI server, side by side.

    python bench/grid_bench.py                 # synthetic SD1.5, 64×64, 2 steps, CPU
    python bench/grid_bench.py --size 128 --steps 4

Each variant is timed from queueing to the last image, with the checkpoint already loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import comfy  # noqa: E402
from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402

VALUES = [0.0, 0.25, 0.5, 1.0]


def models_dir(assets: dict) -> Path:
    d = Path(tempfile.mkdtemp(prefix="grid-bench-models-"))
    for sub in cs.MODEL_SUBDIRS:
        (d / sub).mkdir()
    (d / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    for kind, path in assets["loras"].items():
        os.link(path, d / "loras" / synth.LORA_NAMES[kind]) if os.stat(path).st_dev == os.stat(d).st_dev else \
            (d / "loras" / synth.LORA_NAMES[kind]).write_bytes(Path(path).read_bytes())
    return d


def synthetic_server() -> cs.ComfyServer | None:
    """A started ComfyUI server on the synthetic checkpoint and LoRAs, or None (with a message) without ComfyUI."""
    found = comfy()
    if found is None:
        return None
    root, python, assets = found
    return cs.ComfyServer(comfy_root=root, python=python, models_dir=models_dir(assets)).start()


def base_graph(size: int, steps: int, model, clip, latent, prefix: str, seed: int = 42, cfg: float = 5.0) -> dict:
    """Checkpoint, prompts, sampler, decode and save around `model` and `clip` (node ids 1, 4, 6-10)."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "a lighthouse at dusk"}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "blurry"}},
        "8": {"class_type": "KSampler", "inputs": {"model": model, "positive": ["6", 0], "negative": ["7", 0],
                                                   "latent_image": latent, "seed": seed, "steps": steps, "cfg": cfg,
                                                   "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    }


def cell(size, steps, sx, sy, stock: bool, prefix: str) -> dict:
    a, b = synth.LORA_NAMES["kohya"], synth.LORA_NAMES["locon"]
    if stock:
        g = base_graph(size, steps, ["21", 0], ["21", 1], ["4", 0], prefix)
        g["20"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": a,
                                                          "strength_model": sx, "strength_clip": 0.8}}
        g["21"] = {"class_type": "LoraLoader", "inputs": {"model": ["20", 0], "clip": ["20", 1], "lora_name": b,
                                                          "strength_model": sy, "strength_clip": 0.0}}
        return g
    g = base_graph(size, steps, ["22", 0], ["22", 1], ["4", 0], prefix)
    g["20"] = {"class_type": "LoRAStack", "inputs": {"lora_name": a, "strength_model": sx, "strength_clip": 0.8}}
    g["21"] = {"class_type": "LoRAStack", "inputs": {"lora_name": b, "strength_model": sy, "strength_clip": 0.0,
                                                     "lora_stack": ["20", 0]}}
    g["22"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "clip": ["1", 1],
                                                           "lora_stack": ["21", 0], "max_loras": 0}}
    return g


def grid(size, steps, max_batch: int) -> dict:
    g = cell(size, steps, 0.0, 0.0, stock=False, prefix="grid")
    del g["22"]
    g["23"] = {"class_type": "LoRAStrengthGrid", "inputs": {
        "model": ["1", 0], "clip": ["1", 1], "lora_stack": ["21", 0], "latent": ["4", 0],
        "x_entry": "#1", "x_values": ", ".join(map(str, VALUES)), "y_entry": "#2",
        "y_values": ", ".join(map(str, VALUES)), "z_entry": "", "z_values": "", "max_batch": max_batch}}
    g["6"]["inputs"]["clip"] = g["7"]["inputs"]["clip"] = ["23", 1]
    g["8"]["inputs"].update(model=["23", 0], latent_image=["23", 2])
    g["10"]["inputs"]["images"] = ["24", 0]
    g["24"] = {"class_type": "LoRAGridImage", "inputs": {"images": ["9", 0], "grid": ["23", 3]}}
    return g


def timed(server, prompts: list[dict]) -> float:
    t0 = time.monotonic()
    for p in prompts:
        server.run(p, timeout=3600)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    server = synthetic_server()
    if server is None:
        return 2
    try:
        server.run(cell(args.size, args.steps, 0.5, 0.5, stock=True, prefix="warm"))  # checkpoint loaded once
        cells = [(sx, sy) for sy in VALUES for sx in VALUES]
        t_grid = timed(server, [grid(args.size, args.steps, 16)])
        t_split = timed(server, [grid(args.size, args.steps, 4)])
        t_ours = timed(server, [cell(args.size, args.steps, sx, sy, False, f"o{i}") for i, (sx, sy) in enumerate(cells)])
        t_stock = timed(server, [cell(args.size, args.steps, sx, sy, True, f"s{i}") for i, (sx, sy) in enumerate(cells)])
    finally:
        server.stop()
    print(f"4x4 grid, {args.size}x{args.size}, {args.steps} steps, SD1.5-shaped, CPU "
          f"(load average {os.getloadavg()[0]:.1f})")
    print(f"{'variant':<44} {'seconds':>8} {'vs grid':>8}")
    for name, t in [("LoRAStrengthGrid, one batch of 16", t_grid),
                    ("LoRAStrengthGrid, max_batch 4 (4 batches)", t_split),
                    ("16 sequential runs, MultiLoRALoader", t_ours),
                    ("16 sequential runs, stock LoraLoader chain", t_stock)]:
        print(f"{name:<44} {t:8.1f} {t / t_grid:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
