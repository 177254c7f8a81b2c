"""A second ComfyUI server that samples in a loop: the load a shared machine puts beside the test suite.

    python tools/busy_server.py                     # until Ctrl+C or SIGTERM, or --seconds
    python tools/busy_server.py --size 256 --steps 8 --seconds 4000

It starts a ComfyUI server with the pack on the synthetic SD1.5 checkpoint (tools/synth.py) and queues a stock
prompt (CheckpointLoaderSimple, a LoraLoader, KSampler, VAEDecode, SaveImage) again and again with a new seed each
time, printing one line per prompt. docs/testing.md says how the suite was run beside it.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402


def prompt(seed: int, size: int, steps: int) -> dict:
    lora = synth.LORA_NAMES["kohya"]
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
        "2": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": lora,
                                                      "strength_model": 0.8, "strength_clip": 0.8}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 1], "text": f"a busy machine {seed}"}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 1], "text": "blurry"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "seed": seed,
            "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "busy"}},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256, help="image width and height (default 256)")
    ap.add_argument("--steps", type=int, default=8, help="sampling steps per prompt (default 8)")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default: when told to)")
    args = ap.parse_args()
    root = cs.find_comfy_root()
    if root is None:
        print("no ComfyUI found: set COMFYUI_PATH; looked at "
              + ", ".join(str(p) for p in cs.comfy_search_locations()), file=sys.stderr)
        return 2
    python = cs.find_comfy_python(root)
    assets = synth.ensure_assets_any_python(comfy_root=root, python=python)
    work = Path(tempfile.mkdtemp(prefix="multilora-busy-"))
    models = work / "models"
    for sub in cs.MODEL_SUBDIRS:
        (models / sub).mkdir(parents=True)
    (models / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    (models / "loras" / synth.LORA_NAMES["kohya"]).symlink_to(assets["loras"]["kohya"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that `finally` stops the server
    server = cs.ComfyServer(comfy_root=root, python=python, models_dir=models, workdir=work / "comfy")
    server.start()
    print(f"busy server at {server.url} (log {server.log_path})", flush=True)
    end = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
    seed = 0
    try:
        while time.monotonic() < end:
            t0 = time.monotonic()
            server.run(prompt(seed, args.size, args.steps), timeout=max(cs.RUN_TIMEOUT, 60.0 * args.steps))
            print(f"prompt {seed}: {time.monotonic() - t0:.1f} s", flush=True)
            seed += 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
