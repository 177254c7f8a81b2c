"""Peak resident memory of a real ComfyUI server saving a stack, against the same server sampling with it.

    python bench/save_memory.py [--rank 32] [--reduced 8] [--gpu] [--keep]

Four rank-32 kohya LoRAs (model and clip) of `tools/synth.py` on the synthetic SD1.5 checkpoint, each arm in a
fresh server (`--cpu` unless `--gpu`). After each prompt the server's resident memory is read from
/proc/<pid>/status: VmHWM, its peak since it started, and the prompt's own peak (VmHWM reset before the prompt by
writing 5 to /proc/<pid>/clear_refs; "-" where the kernel refuses).

- `sample → save`: MultiLoRALoader with the stack, one 64×64 2-step image, twice (the second warm, another seed);
  then LoRAStackSave of the same stack, exact, then reduced to `--reduced`. "vs sampling": the server's peak against
  its peak after sampling (the bound of the issue: at most +10 %); "vs warm sampling": the prompt's own peak against
  the warm sampling's own.
- `save alone`: LoRAStackSave, exact, in a fresh server that samples nothing.
- `LoRAStackAsPatches → CheckpointSave` against `stock LoraLoader chain → CheckpointSave`, each in a fresh server:
  only where this pack registers LoRAStackAsPatches; else the arm says it was skipped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import comfy, machine_line  # noqa: E402
from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402

COUNT = 4
GIB = 1024 ** 3


def vm(pid: int, field: str = "VmHWM") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak(pid: int) -> bool:
    """Set the process's VmHWM back to its current resident memory (Linux: 5 to /proc/<pid>/clear_refs), so that
    the next reading is the next prompt's own peak; False where the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def stack_nodes(names: list[str]) -> tuple[dict, list]:
    nodes, prev = {}, None
    for j, name in enumerate(names):
        inputs = {"lora_name": name, "strength_model": 0.6, "strength_clip": 0.5}
        if prev is not None:
            inputs["lora_stack"] = prev
        nodes[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
        prev = [f"s{j}", 0]
    return nodes, prev


def checkpoint() -> dict:
    return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}}}


def sample(names: list[str], seed: int = 1) -> dict:
    nodes, ref = stack_nodes(names)
    p = {**checkpoint(), **nodes,
         "ml": {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_stack": ref}},
         "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["ml", 1], "text": "a synthetic test image"}},
         "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["ml", 1], "text": "blurry"}},
         "7": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "8": {"class_type": "KSampler", "inputs": {
             "model": ["ml", 0], "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "seed": seed,
             "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
         "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
         "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "bench"}}}
    return p


def save(names: list[str], filename: str, rank: int) -> dict:
    nodes, ref = stack_nodes(names)
    return {**checkpoint(), **nodes, "save": {"class_type": "LoRAStackSave", "inputs": {
        "model": ["1", 0], "clip": ["1", 1], "lora_stack": ref, "filename": filename, "rank": rank,
        "overwrite": True}}}


def checkpoint_save(names: list[str], patches: bool) -> dict:
    p = checkpoint()
    model, clip = ["1", 0], ["1", 1]
    if patches:
        nodes, ref = stack_nodes(names)
        p.update(nodes)
        p["ap"] = {"class_type": "LoRAStackAsPatches", "inputs": {"model": model, "clip": clip, "lora_stack": ref}}
        model, clip = ["ap", 0], ["ap", 1]
    else:
        for j, name in enumerate(names):
            p[f"l{j}"] = {"class_type": "LoraLoader", "inputs": {"model": model, "clip": clip, "lora_name": name,
                                                                 "strength_model": 0.6, "strength_clip": 0.5}}
            model, clip = [f"l{j}", 0], [f"l{j}", 1]
    p["cs"] = {"class_type": "CheckpointSave", "inputs": {"model": model, "clip": clip, "vae": ["1", 2],
                                                          "filename_prefix": "checkpoints/bench"}}
    return p


def arm(server_args: dict, prompts: list[tuple[str, dict]]) -> list[tuple[str, int, int | None]]:
    """Each prompt's label, the server's VmHWM after it (its peak since it started), and the peak during that prompt
    alone (None where the kernel does not reset the peak), in one fresh server."""
    srv = cs.ComfyServer(**server_args)
    rows, peak = [], 0
    try:
        srv.start()
        if srv.pack_import_error():
            raise RuntimeError(srv.pack_import_error())
        pid = srv.proc.pid
        peak = vm(pid)
        rows.append(("started", peak, None))
        for label, prompt in prompts:
            own = reset_peak(pid)
            srv.wait(srv.post_prompt(prompt), timeout=3600)
            now = vm(pid)
            peak = max(peak, now)
            rows.append((label, peak, now if own else None))
        return rows
    finally:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)


def table(title: str, rows, sampled: int, warm: int | None) -> None:
    """The rows of `arm`: the server's peak against its peak after the first sampling (`sampled`), and each prompt's
    own peak against a warm sampling's own (`warm`)."""
    print(f"\n{title:<40} {'VmHWM GiB':>10} {'vs sampling':>12} {'own peak GiB':>13} {'vs warm sampling':>17}")
    for label, peak, own in rows:
        mine = f"{own / GIB:13.2f}" if own is not None else f"{'-':>13}"
        ratio = f"{own / warm - 1:+16.1%}" if own is not None and warm else f"{'-':>17}"
        print(f"{label:<40} {peak / GIB:10.2f} {peak / sampled - 1:+11.1%} {mine} {ratio}")


def registered(server_args: dict, node: str) -> bool:
    srv = cs.ComfyServer(**server_args)
    try:
        srv.start()
        return node in srv.object_info()
    finally:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=32, help="rank of each of the four LoRAs")
    ap.add_argument("--reduced", type=int, default=8, help="the reduced save's rank")
    ap.add_argument("--gpu", action="store_true", help="run the servers on the GPU (default --cpu)")
    ap.add_argument("--keep", action="store_true", help="keep the models folder")
    args = ap.parse_args()
    found = comfy()
    if found is None:
        return 2
    root, python, assets = found
    mdir = Path(tempfile.mkdtemp(prefix="multilora-save-bench-"))
    for sub in cs.MODEL_SUBDIRS:
        (mdir / sub).mkdir()
    (mdir / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    names = []
    for i in range(COUNT):
        src = synth.cached_lora("kohya", seed=700 + i, rank=args.rank, comfy_root=root, python=python)
        names.append(f"bench_save_r{args.rank}_{i}.safetensors")
        try:
            os.link(src, mdir / "loras" / names[-1])
        except OSError:
            shutil.copyfile(src, mdir / "loras" / names[-1])
    server_args = dict(comfy_root=root, python=python, models_dir=mdir, cpu=not args.gpu,
                       extra_args=["--cache-classic"])
    print(machine_line())
    print(f"{COUNT} kohya LoRAs of rank {args.rank} (model and clip, {sum((mdir / 'loras' / n).stat().st_size for n in names) / 2**20:.0f} MiB) "
          f"on the synthetic SD1.5 checkpoint ({Path(assets['checkpoint']).stat().st_size / GIB:.2f} GiB); "
          f"{'GPU' if args.gpu else 'CPU'}")
    try:
        rows = arm(server_args, [("sample (MultiLoRALoader, first)", sample(names)),
                                 ("sample again (another seed)", sample(names, seed=2)),
                                 ("LoRAStackSave exact", save(names, "bench_exact.safetensors", 0)),
                                 (f"LoRAStackSave rank {args.reduced}",
                                  save(names, f"bench_r{args.reduced}.safetensors", args.reduced))])
        sampled = rows[1][1]
        table("sample → save (one server)", rows, sampled, rows[2][2])
        exact = (mdir / "loras" / "bench_exact.safetensors").stat().st_size
        print(f"exact file {exact / 2**20:.0f} MiB")
        alone = arm(server_args, [("LoRAStackSave exact", save(names, "bench_alone.safetensors", 0))])
        table("save alone (fresh server)", alone, sampled, rows[2][2])
        if registered(server_args, "LoRAStackAsPatches"):
            print(f"\n{'CheckpointSave (fresh servers)':<40} {'VmHWM GiB':>10} {'vs stock':>12}")
            stock = arm(server_args, [("stock LoraLoader chain", checkpoint_save(names, False))])[-1][1]
            ours = arm(server_args, [("LoRAStackAsPatches", checkpoint_save(names, True))])[-1][1]
            print(f"{'stock LoraLoader chain → CheckpointSave':<40} {stock / GIB:10.2f} {0:+11.1%}")
            print(f"{'LoRAStackAsPatches → CheckpointSave':<40} {ours / GIB:10.2f} {ours / stock - 1:+11.1%}")
        else:
            print("\nLoRAStackAsPatches → CheckpointSave: skipped (this pack does not register LoRAStackAsPatches)")
    finally:
        if not args.keep:
            shutil.rmtree(mdir, ignore_errors=True)
    print(machine_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
