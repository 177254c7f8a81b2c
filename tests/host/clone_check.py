"""A MultiLoRALoader output that ComfyUI clones onto a model object of its own, sampled in-process.

Run with ComfyUI's python (tests/host/test_clones.py does):

    ~/comfy/ComfyUI/.venv/bin/python tests/host/clone_check.py [--out result.json]

Some of ComfyUI's clones do not share the model they were cloned from: they hold a model loaded afresh from the
loader's `cached_patcher_init`. `clone(disable_dynamic=True)` does this under the dynamic-VRAM loader
(TorchCompileModel on CUDA), `clone(force_deepcopy=True)` on any device (the training node), and
`deepclone_multigpu` once per GPU. Here the tiny Flux of family_layouts.py is written as a diffusion-model file
and loaded with `comfy.sd.load_diffusion_model`, which registers that factory, so `clone(force_deepcopy=True)`
takes on the CPU the path the other two take.

Each sample is `comfy.sample.sample` (Euler, 2 steps, cfg 1, one seed), so ComfyUI loads the model, runs its
injections and its APPLY_MODEL wrappers as a KSampler does:

    base          the loaded model, no LoRA
    ours          bridge.apply_stack of two LoRAs (kohya 1.0, diffusers -0.6)
    ours_fresh    ours.clone(force_deepcopy=True)
    stock         comfy.sd.load_lora_for_models per file
    stock_fresh   stock.clone(force_deepcopy=True): ComfyUI's weight patches travel with the clone
    sched         ours with a schedule `0:0, 1:1` on the first entry (the wrapper sets the progress per step)
    sched_fresh   sched.clone(force_deepcopy=True)

and base again at the end. The result is one JSON object of max-abs differences; test_clones.py holds them to
their bounds.

This module imports neither torch nor ComfyUI at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the layouts and the tools are imported from the repository
    sys.path.insert(0, str(ROOT))

from tests.host.family_layouts import Writer, families  # noqa: E402  (after the sys.path line)

ENTRIES = (("kohya", 1.0), ("diffusers", -0.6))
SCHEDULE = "0:0, 1:1"


def check(comfy, torch, bridge, folder: str) -> dict:
    from safetensors.torch import save_file

    from lora_engine import AdapterCache
    from lora_engine.schedule import Schedule
    from tools.comfy_inprocess import build_model
    mm = comfy.model_management
    fam = families(comfy)["flux"]
    built = build_model(comfy, torch, fam.unet_config, dtype=torch.float32, device=torch.device("cpu"),
                        expect=fam.expect)
    unet_path = os.path.join(folder, "flux_unet.safetensors")
    save_file({k: v.contiguous() for k, v in built.model.diffusion_model.state_dict().items()}, unet_path)
    base = comfy.sd.load_diffusion_model(unet_path)  # as UNETLoader: cached_patcher_init is the loader itself
    modules = dict(base.model.named_modules())
    keymap = comfy.lora.model_lora_keys_unet(base.model, {})
    cache = AdapterCache(max_items=8, max_bytes=1 << 30)
    files, adapters = [], []
    for i, (layout, _) in enumerate(ENTRIES):
        w = Writer(torch, modules, keymap, torch.Generator().manual_seed(100 + i), base.model.model_config.unet_config)
        fam.layouts[layout](w)
        path = os.path.join(folder, f"flux_{layout}.safetensors")
        save_file(w.sd, path)
        files.append(comfy.utils.load_torch_file(path, safe_load=True))
        adapters.append(cache.load(path, name=os.path.basename(path), convert=comfy.lora_convert.convert_lora,
                                   convert_id="comfy"))

    inputs = fam.inputs(torch, torch.Generator().manual_seed(1))
    positive = [[inputs["context"], {"pooled_output": inputs["y"], "guidance": 3.5}]]
    latent = torch.zeros_like(inputs["x"])
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(7))

    def sample(model):
        out = comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", positive, positive, latent,
                                  disable_pbar=True, seed=7)
        return out.float()

    strengths = [s for _, s in ENTRIES]
    k = len(adapters)
    samples = {"base": sample(base)}
    ours = bridge.apply_stack(base, None, adapters, strengths, [0.0] * k, k)[0]
    samples["ours"] = sample(ours)
    ours_fresh = ours.clone(force_deepcopy=True)
    samples["ours_fresh"] = sample(ours_fresh)
    stock = base
    for sd, strength in zip(files, strengths):
        stock = comfy.sd.load_lora_for_models(stock, None, sd, strength, 0)[0]
    samples["stock"] = sample(stock)
    samples["stock_fresh"] = sample(stock.clone(force_deepcopy=True))
    shaping = [bridge.Shaping(schedule=Schedule.parse(SCHEDULE))] + [None] * (k - 1)
    sched = bridge.apply_stack(base, None, adapters, strengths, [0.0] * k, k, shaping=shaping)[0]
    samples["sched"] = sample(sched)
    sched_fresh = sched.clone(force_deepcopy=True)
    samples["sched_fresh"] = sample(sched_fresh)
    samples["base_after"] = sample(base)
    mm.unload_all_models()

    def diff(a: str, b: str) -> float:
        return (samples[a] - samples[b]).abs().max().item()

    return {
        "fresh_models": [ours_fresh.model is not ours.model, sched_fresh.model is not sched.model],
        "stock_max": samples["stock"].abs().max().item(),
        "ours_vs_stock": diff("ours", "stock"),
        "base_vs_stock": diff("base", "stock"),
        "fresh_vs_ours": diff("ours_fresh", "ours"),
        "fresh_vs_stock_fresh": diff("ours_fresh", "stock_fresh"),
        "stock_fresh_vs_stock": diff("stock_fresh", "stock"),
        "sched_vs_ours": diff("sched", "ours"),
        "sched_fresh_vs_sched": diff("sched_fresh", "sched"),
        "base_after_vs_base": diff("base_after", "base"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder; default $COMFYUI_PATH, else ~/comfy/ComfyUI")
    ap.add_argument("--out", help="also write the JSON object to this file")
    args = ap.parse_args()
    from tools.comfy_inprocess import find_comfy, import_bridge, import_comfy
    comfy = import_comfy(find_comfy(args.comfy), "cpu")
    import torch
    torch.set_num_threads(1)  # a tiny model: on a shared CPU, threads only wait for each other
    bridge = import_bridge()
    with tempfile.TemporaryDirectory(prefix="multilora-clones-") as folder:
        result = check(comfy, torch, bridge, folder)
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
