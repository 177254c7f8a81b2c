"""Peak host memory of DistillFuse against stock UNETLoader + LoraLoaderModelOnly, on the synthetic
SD1.5 UNet, each measured in a fresh process running ComfyUI's own code on the CPU.

    python bench/distill_memory.py [--weight-dtype default|fp8_e4m3fn]

It prints, per variant, the peak resident memory (VmHWM) above the process's memory after
importing ComfyUI, next to the model's parameter bytes: DistillFuse streams the fusion layer by
layer and keeps no backups; the stock path keeps a backup of every patched weight.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import comfy  # noqa: E402
from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402

CHILD = r'''
import json, os, sys
comfy_root, pack_root, unet, lora_dir, lora, variant, weight_dtype = sys.argv[1:8]
sys.path.insert(0, comfy_root); os.chdir(comfy_root)
from comfy.cli_args import args
args.cpu = True
import torch, comfy.sd, comfy.utils, folder_paths, comfy.model_management


def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


folder_paths.add_model_folder_path("loras", lora_dir)
import asyncio, importlib, nodes as comfy_nodes  # ComfyUI's nodes.py: comfy_root is first on sys.path
if not asyncio.run(comfy_nodes.load_custom_node(pack_root)):  # the pack, loaded as ComfyUI loads it
    sys.exit(f"ComfyUI's load_custom_node did not load {pack_root} (its log line above says why)")
pack = sys.modules[pack_root.replace(".", "_x_")]  # the name load_custom_node gives a folder
bridge = importlib.import_module(pack.__name__ + ".nodes.bridge")
distill = importlib.import_module(pack.__name__ + ".nodes.distill")
base = rss("VmRSS")
options = bridge.unet_options(weight_dtype)
if variant == "distillfuse":
    model = distill.load_fused(unet, options, lora, 0.7)
    backups = 0
else:
    model = comfy.sd.load_diffusion_model(unet, model_options=options, disable_dynamic=True)
    sd = comfy.utils.load_torch_file(os.path.join(lora_dir, lora), safe_load=True)
    model, _ = comfy.sd.load_lora_for_models(model, None, sd, 0.7, 0.0)
    del sd
    model.patch_model(device_to=torch.device("cpu"))  # what loading for sampling does
    backups = sum(v.weight.numel() * v.weight.element_size() for v in model.backup.values())
params = sum(p.numel() * p.element_size() for p in model.model.parameters())
print(json.dumps({"variant": variant, "peak_above_base": rss("VmHWM") - base, "params": params,
                  "backups": backups}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-dtype", default="default", choices=["default", "fp8_e4m3fn", "fp8_e5m2"])
    args = ap.parse_args()
    found = comfy()
    if found is None:
        return 2
    root, python, assets = found
    work = Path(tempfile.mkdtemp(prefix="distill-mem-"))
    unet = work / "unet.safetensors"
    subprocess.run([python, "-c", (
        "import sys; from safetensors import safe_open; from safetensors.torch import save_file\n"
        "p='model.diffusion_model.'\n"
        "with safe_open(sys.argv[1], 'pt') as f: sd = {k[len(p):]: f.get_tensor(k) for k in f.keys() "
        "if k.startswith(p)}\n"
        "save_file(sd, sys.argv[2])"), str(assets["checkpoint"]), str(unet)], check=True)
    loras = work / "loras"
    loras.mkdir()
    lora = synth.LORA_NAMES["kohya"]
    (loras / lora).write_bytes(Path(assets["loras"]["kohya"]).read_bytes())
    env = dict(os.environ)
    if not cs.python_has_module(python, "torchaudio"):
        cs.write_torchaudio_stub(work / "shims")
        env["PYTHONPATH"] = str(work / "shims") + os.pathsep + env.get("PYTHONPATH", "")
    rows = []
    for variant in ("distillfuse", "stock"):
        out = subprocess.run([python, "-c", CHILD, str(root), str(cs.PACK_ROOT), str(unet), str(loras), lora,
                              variant, args.weight_dtype], env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 1024 ** 3
    print(f"UNet {unet.stat().st_size / gib:.2f} GiB on disk; weight_dtype {args.weight_dtype}; CPU")
    print(f"{'variant':<40} {'params GiB':>10} {'backups GiB':>12} {'peak above base GiB':>20} {'peak / params':>14}")
    for r in rows:
        name = "DistillFuse" if r["variant"] == "distillfuse" else "UNETLoader + LoraLoaderModelOnly"
        print(f"{name:<40} {r['params'] / gib:10.2f} {r['backups'] / gib:12.2f} {r['peak_above_base'] / gib:20.2f} "
              f"{r['peak_above_base'] / r['params']:13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
