"""Run an API-format workflow headlessly on a ComfyUI install and write its images.

    python tools/run_workflow.py examples/workflows/multilora_api.json --out out/
    python tools/run_workflow.py WORKFLOW --url http://127.0.0.1:8188 --out out/   # a running server
    python tools/run_workflow.py WORKFLOW --synthetic --out out/                   # no weights needed

By default it starts ComfyUI from $COMFYUI_PATH (else ~/comfy/ComfyUI) on 127.0.0.1 with this pack
installed, using that install's own models folders. `--synthetic` generates an SD1.5-shaped
checkpoint and three LoRAs with random weights and real key layouts, maps the example's file names
onto them, and samples at 64×64 in 2 steps: it shows the pack working where no weights exist. The
server then sees only those files, none of the install's own models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import comfy_server as cs  # noqa: E402

SYNTHETIC_NAMES = {  # example names -> synthetic LoRA kinds
    "style.safetensors": "kohya",
    "character.safetensors": "peft",
    "detail.safetensors": "locon",
}


def synthetic_models(comfy_root: Path, python: str) -> tuple[Path, dict[str, str]]:
    from tools import synth
    assets = synth.ensure_assets_any_python(comfy_root=comfy_root, python=python)
    models = Path(tempfile.mkdtemp(prefix="multilora-models-"))
    for sub in cs.MODEL_SUBDIRS:
        (models / sub).mkdir()
    (models / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    names = {}
    for example_name, kind in SYNTHETIC_NAMES.items():
        dst = models / "loras" / synth.LORA_NAMES[kind]
        try:
            os.link(assets["loras"][kind], dst)
        except OSError:
            import shutil
            shutil.copyfile(assets["loras"][kind], dst)
        names[example_name] = synth.LORA_NAMES[kind]
    return models, names


def shrink(prompt: dict, names: dict[str, str], ckpt: str) -> dict:
    stems = {Path(a).stem: Path(b).stem for a, b in names.items()}
    for node in prompt.values():
        inputs = node.get("inputs", {})
        for key, value in inputs.items():  # grid axes name stack entries by file stem
            if key.endswith("_entry") and isinstance(value, str) and value in stems:
                inputs[key] = stems[value]
        if "ckpt_name" in inputs:
            inputs["ckpt_name"] = ckpt
        if isinstance(inputs.get("lora_name"), str):
            inputs["lora_name"] = names.get(inputs["lora_name"], inputs["lora_name"])
        if node.get("class_type") == "EmptyLatentImage":
            inputs.update(width=64, height=64)
        if node.get("class_type") == "KSampler":
            inputs.update(steps=2, cfg=2.0)
    return prompt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workflow", nargs="?", default="examples/workflows/multilora_api.json",
                    help="an API-format workflow (File > Export (API) in the ComfyUI menu)")
    ap.add_argument("--out", default="out", help="folder for the images")
    ap.add_argument("--url", help="use a running ComfyUI server instead of starting one")
    ap.add_argument("--synthetic", action="store_true", help="generate synthetic SD1.5 weights and LoRAs")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the images")
    args = ap.parse_args()

    prompt = json.loads(Path(args.workflow).read_text())
    for node in prompt.values():
        node.pop("_meta", None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    server = None
    if args.url:
        server = cs.ComfyServer.attach(args.url)
    else:
        root = cs.find_comfy_root()
        if root is None:
            print("no ComfyUI found: set COMFYUI_PATH, or pass --url of a running server; looked at "
                  + ", ".join(str(p) for p in cs.comfy_search_locations()), file=sys.stderr)
            return 2
        python = cs.find_comfy_python(root)
        models = None
        if args.synthetic:
            from tools import synth
            models, names = synthetic_models(root, python)
            prompt = shrink(prompt, names, synth.CHECKPOINT_NAME)
        # Synthetic weights: the server sees only those; else the workflow's own files, in the checkout's models.
        server = cs.ComfyServer(comfy_root=root, python=python, models_dir=models, own_models_only=args.synthetic)
        server.start()
    try:
        t0 = time.monotonic()
        images = server.run(prompt, timeout=args.timeout)
        from PIL import Image
        for i, img in enumerate(images):
            path = out / f"{Path(args.workflow).stem}_{i:02d}.png"
            Image.fromarray(img).save(path)
            print(f"wrote {path} ({img.shape[1]}x{img.shape[0]})")
        print(f"{len(images)} image(s) in {time.monotonic() - t0:.1f} s")
        return 0
    except cs.ComfyError as e:
        print(f"workflow failed: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.url:
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
