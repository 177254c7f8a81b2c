"""Re-run cost on a real ComfyUI server: our nodes against stock LoraLoader and LoraLoaderBypass chains.

Starts ComfyUI (found at $COMFYUI_PATH, else ~/comfy/ComfyUI, run with its own python, on
127.0.0.1, `--cpu` unless --gpu) with this pack installed and the synthetic SD1.5-shaped checkpoint
and LoRAs of tools/synth.py (a 4th kohya LoRA is generated for k=4). For each k LoRAs it queues, per
variant, the same small graph (checkpoint -> LoRAs -> 2x CLIPTextEncode -> KSampler at 64x64,
1 step, cfg 1 -> VAEDecode -> SaveImage):

  ours    LoRAStack chain -> MultiLoRALoader (model + clip)
  stock   chained LoraLoader nodes (fuses every LoRA into the weights; re-patches on a change)
  bypass  LoraLoaderBypass, one LoRA only: chained LoraLoaderBypass nodes apply only the last LoRA
          in ComfyUI 0.28 (and it skips SD1.5 CLIP keys), so k > 1 is not a valid comparison

and times, after one warm-up run:

  strength re-run  the same graph re-queued with only the first LoRA's strength_model changed
  seed re-run      the same graph re-queued with only the KSampler seed changed

Times are the server's own execution wall time (from the prompt's execution_start to
execution_success timestamps), median over --repeat runs. "load" is the time ComfyUI spent in
comfy.model_management.load_models_gpu during the run (moving models, applying or removing weight
patches, injecting hooks), read from the server log, where a bench-only probe (bench/comfy_probe/,
a timer around ComfyUI's own function) writes one line per call; --no-probe leaves it out.

    python bench/host_bench.py                    # k = 1, 2, 4; 3 repeats; 7 to 12 minutes on a shared 2-core CPU
    python bench/host_bench.py --ks 1,2 --repeat 5 --steps 2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grid_bench import base_graph  # noqa: E402
from bench.machine import comfy, machine_line  # noqa: E402
from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402

PROBE_DIR = ROOT / "bench" / "comfy_probe"
EXTRA_LORA = ("synth_kohya_b.safetensors", dict(kind="kohya", seed=404, rank=8))
LORA_ORDER = ("kohya", "peft", "locon")  # then EXTRA_LORA
VARIANTS = ("ours", "stock", "bypass")
PROBE_RE = re.compile(r"\[bench-probe\] load_models_gpu ([0-9.]+) s: (\S*)")
NODE_RE = re.compile(r"\[bench-probe\] node (\S+) (\S+) ([0-9.]+) s")


def models_dir(assets: dict, extra: Path) -> tuple[Path, list[str]]:
    root = Path(tempfile.mkdtemp(prefix="multilora-bench-models-"))
    for sub in cs.MODEL_SUBDIRS:
        (root / sub).mkdir()
    (root / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    names = []
    # Real files (hard links, else copies), not symlinks: the pack refuses names that resolve
    # outside the loras folders.
    for kind in LORA_ORDER:
        _place(assets["loras"][kind], root / "loras" / synth.LORA_NAMES[kind])
        names.append(synth.LORA_NAMES[kind])
    _place(extra, root / "loras" / EXTRA_LORA[0])
    names.append(EXTRA_LORA[0])
    return root, names


def _place(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def graph(variant: str, loras: list[str], strengths: list[float], seed: int, size: int, steps: int,
          cfg: float) -> dict:
    p = {}
    model, clip = ["1", 0], ["1", 1]
    if variant == "ours":
        prev = None
        for j, (name, s) in enumerate(zip(loras, strengths)):
            inputs = {"lora_name": name, "strength_model": s, "strength_clip": 0.8, "enabled": True}
            if prev is not None:
                inputs["lora_stack"] = [prev, 0]
            p[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
            prev = f"s{j}"
        p["ml"] = {"class_type": "MultiLoRALoader", "inputs": {"model": model, "clip": clip,
                                                               "lora_stack": [prev, 0], "max_loras": 0}}
        model, clip = ["ml", 0], ["ml", 1]
    else:
        cls = {"stock": "LoraLoader", "bypass": "LoraLoaderBypass"}[variant]
        for j, (name, s) in enumerate(zip(loras, strengths)):
            p[f"l{j}"] = {"class_type": cls, "inputs": {"model": model, "clip": clip, "lora_name": name,
                                                         "strength_model": s, "strength_clip": 0.8}}
            model, clip = [f"l{j}", 0], [f"l{j}", 1]
    return {**base_graph(size, steps, model, clip, ["4", 0], f"bench_{variant}", seed=seed, cfg=cfg), **p}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc; NaN where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def run_once(srv: cs.ComfyServer, prompt: dict) -> dict:
    """Queue, wait, and return {"exec": s, "cpu": s, "load": {model class: s}, "nodes": {...}, "wall": s}."""
    off = srv.log_offset()
    cpu0 = cpu_seconds(srv.proc.pid)
    t0 = time.perf_counter()
    pid = srv.post_prompt(prompt)
    entry = srv.wait(pid, poll=0.05)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(srv.proc.pid) - cpu0
    ts = {ev: data.get("timestamp") for ev, data in entry.get("status", {}).get("messages", [])}
    exec_s = (ts["execution_success"] - ts["execution_start"]) / 1000.0 \
        if ts.get("execution_success") and ts.get("execution_start") else wall
    load: dict[str, float] = {}
    nodes: dict[str, float] = {}
    # the probe line of the last call can land a moment after the history entry
    time.sleep(0.05)
    text = srv.log_text(off)
    for m in PROBE_RE.finditer(text):
        load[m.group(2)] = load.get(m.group(2), 0.0) + float(m.group(1))
    for m in NODE_RE.finditer(text):
        nodes[m.group(2)] = nodes.get(m.group(2), 0.0) + float(m.group(3))
    return {"exec": exec_s, "cpu": cpu, "load": load, "nodes": nodes, "wall": wall}


def node_line(runs: list[dict]) -> str:
    """Median seconds per node class over runs (classes that ran in every run)."""
    classes = sorted(set.intersection(*(set(r["nodes"]) for r in runs)) if runs else set(),
                     key=lambda c: -med([r["nodes"][c] for r in runs]))
    return ", ".join(f"{c} {med([r['nodes'][c] for r in runs]):.2f}" for c in classes)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def load_parts(runs: list[dict]) -> tuple[float, float, float]:
    """Median load seconds: (diffusion model, text encoder, total)."""
    unet = [sum(v for k, v in r["load"].items() if "BaseModel" in k or k in ("SD15", "Model")) for r in runs]
    clip = [sum(v for k, v in r["load"].items() if "Clip" in k or "CLIP" in k) for r in runs]
    total = [sum(r["load"].values()) for r in runs]
    return med(unet), med(clip), med(total)


def print_tables(results: dict, ks: list[int], variants: list[str], probe: bool, bypass_chains: bool) -> None:
    def f(v, w, d=2):
        return f"{'-':>{w}}" if v is None or v != v else f"{v:{w}.{d}f}"

    print("\nMedian per re-run, seconds. wall: the server's execution time (execution_start to execution_success);"
          "\ncpu: the server process's CPU time over the run (all threads; less sensitive to other jobs' load);"
          "\nload: time inside load_models_gpu (model / text encoder): moving, patching, unpatching, injecting.\n")
    hdr = (f"{'k':>2} {'variant':<8}| {'first':>6} | {'strength re-run':^15} {'load':^13} | {'seed re-run':^15} "
           f"{'load':>6} | {'strength - seed':>15}")
    sub = (f"{'':>2} {'':<8}| {'wall':>6} | {'wall':>7} {'cpu':>7} {'model':>6} {'te':>6} | {'wall':>7} {'cpu':>7} "
           f"{'model':>6} | {'wall':>7} {'cpu':>7}")
    print(hdr)
    print(sub)
    print("-" * len(sub))
    for k in ks:
        for variant in variants:
            r = results.get((variant, k))
            if r is None:
                if variant == "bypass":
                    print(f"{k:>2} {variant:<8}|  n/a: chained LoraLoaderBypass applies only the last LoRA in "
                          f"ComfyUI 0.28 (--bypass-chains times it anyway)")
                continue
            sw, sc = med([x["exec"] for x in r["strength"]]), med([x["cpu"] for x in r["strength"]])
            ew, ec = med([x["exec"] for x in r["seed"]]), med([x["cpu"] for x in r["seed"]])
            su, st, _ = load_parts(r["strength"]) if probe else (None, None, None)
            eu, _, _ = load_parts(r["seed"]) if probe else (None, None, None)
            label = variant + ("*" if variant == "bypass" and k > 1 else "")
            print(f"{k:>2} {label:<8}| {f(r['first']['exec'], 6)} | {f(sw, 7)} {f(sc, 7)} {f(su, 6)} {f(st, 6)} | "
                  f"{f(ew, 7)} {f(ec, 7)} {f(eu, 6)} | {f(sw - ew, 7)} {f(sc - ec, 7)}")

    print("\nratios in one run, same k: stock variant / ours (above 1: ours is faster)")
    hdr = (f"{'k':>2} | {'stock/ours strength':^17} | {'stock/ours seed':^17} | {'bypass/ours strength':^20} | "
           f"{'bypass/ours seed':^17}")
    sub = f"{'':>2} | " + " | ".join(f"{'wall':>8} {'cpu':>8}" for _ in range(4))
    print(hdr)
    print(sub)
    print("-" * len(hdr))
    for k in ks:
        ours = results.get(("ours", k))
        if ours is None:
            continue
        cells = []
        for v in ("stock", "bypass"):
            r = results.get((v, k))
            for measure in ("strength", "seed"):
                for field in ("exec", "cpu"):
                    if r is None:
                        cells.append("n/a")
                        continue
                    a = med([x[field] for x in r[measure]])
                    b = med([x[field] for x in ours[measure]])
                    cells.append(f"{a / b:.2f}x" if b else "-")
        pairs = [f"{cells[i]:>8} {cells[i + 1]:>8}" for i in range(0, 8, 2)]
        print(f"{k:>2} | " + " | ".join(pairs))
    print("\nnotes: stock LoraLoader fuses each LoRA into model and text-encoder weights, so a strength change "
          "re-patches both\n(and re-encodes the prompt); ours re-activates resident slots (no file read, no copy). "
          "LoraLoaderBypass skips\nSD1.5 CLIP keys in 0.28, so its text encoder runs without the LoRA."
          + ("\n* bypass k>1: a chain applies only its last LoRA." if bypass_chains else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,2,4", help="LoRA counts, comma separated, at most 4 (default 1,2,4)")
    ap.add_argument("--repeat", type=int, default=3, help="timed re-runs per measure; the median is printed")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="any of ours,stock,bypass")
    ap.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    ap.add_argument("--steps", type=int, default=1, help="sampler steps (default 1)")
    ap.add_argument("--cfg", type=float, default=1.0,
                    help="CFG (default 1.0: ComfyUI then runs the model once per step, on the positive prompt only)")
    ap.add_argument("--bypass-chains", action="store_true",
                    help="also time LoraLoaderBypass chains for k > 1 (they apply only the last LoRA)")
    ap.add_argument("--no-probe", action="store_true", help="do not load the load_models_gpu timing probe")
    ap.add_argument("--ram-cache", action="store_true",
                    help="keep ComfyUI's default RAM-pressure cache (default here: --cache-classic)")
    ap.add_argument("--gpu", action="store_true", help="start ComfyUI without --cpu")
    ap.add_argument("--keep", action="store_true", help="keep the server's work directory (its log)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if max(ks) > 4 or min(ks) < 1:
        ap.error("--ks: 1 to 4 LoRAs")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}")

    t_start = time.monotonic()
    print(f"machine: {machine_line()}")
    found = comfy()
    if found is None:
        return 2
    root, python, assets = found
    manifest = synth.shape_manifest(comfy_root=root, python=python)
    extra = synth.cached_lora(manifest=manifest, **EXTRA_LORA[1])
    mdir, names = models_dir(assets, extra)
    print(f"ComfyUI: {root} ({python}); SD1.5-shaped synthetic checkpoint; LoRAs in order: {', '.join(names)}")
    print(f"graph: CLIPTextEncode x2, KSampler {args.size}x{args.size}, {args.steps} step(s), cfg {args.cfg}, "
          f"VAEDecode, SaveImage; median of {args.repeat} re-runs after one warm-up run\n")

    # Classic caching: ComfyUI's default RAM-pressure cache drops cached outputs (the checkpoint too)
    # whenever free RAM dips under its headroom, which other jobs on a shared machine cause at random.
    srv = cs.ComfyServer(comfy_root=root, python=python, models_dir=mdir, cpu=not args.gpu,
                         other_packs=[] if args.no_probe else [PROBE_DIR],
                         extra_args=[] if args.ram_cache else ["--cache-classic"])
    results: dict[tuple[str, int], dict] = {}
    try:
        srv.start()
        if srv.pack_import_error():
            print(srv.pack_import_error(), file=sys.stderr)
            return 1
        # Load the checkpoint once, with no LoRA, so that no variant's first run pays for it.
        warm = run_once(srv, graph("stock", [], [], 0, size=args.size, steps=args.steps, cfg=args.cfg))
        print(f"  warm-up (checkpoint load, no LoRA): {warm['exec']:.2f} s", flush=True)
        for k in ks:
            for variant in variants:
                if variant == "bypass" and k > 1 and not args.bypass_chains:
                    continue
                loras = names[:k]
                strengths = [0.8] * k
                seed = 1
                kw = dict(size=args.size, steps=args.steps, cfg=args.cfg)
                first = run_once(srv, graph(variant, loras, strengths, seed, **kw))
                strength_runs, seed_runs = [], []
                for i in range(args.repeat):
                    strengths = [round(0.79 - 0.01 * i, 2)] + strengths[1:]  # a new value every time
                    strength_runs.append(run_once(srv, graph(variant, loras, strengths, seed, **kw)))
                for i in range(args.repeat):
                    seed += 1
                    seed_runs.append(run_once(srv, graph(variant, loras, strengths, seed, **kw)))
                results[(variant, k)] = {"first": first, "strength": strength_runs, "seed": seed_runs}
                s_unet, s_clip, _ = load_parts(strength_runs)
                print(f"  k={k} {variant:<6} first {first['exec']:6.2f} s | strength re-run "
                      f"{med([r['exec'] for r in strength_runs]):6.2f} s (load: model {s_unet:.2f}, "
                      f"text encoder {s_clip:.2f}) | seed re-run {med([r['exec'] for r in seed_runs]):6.2f} s",
                      flush=True)
                if not args.no_probe:
                    print(f"      nodes, strength re-run (s): {node_line(strength_runs)}", flush=True)
                    print(f"      nodes, seed re-run (s):     {node_line(seed_runs)}", flush=True)
    finally:
        srv.stop()
        if not args.keep:
            srv.cleanup()
        else:
            print(f"server work directory kept: {srv.workdir}")
        shutil.rmtree(mdir, ignore_errors=True)

    print(f"\nmachine after the run: {machine_line()}; whole run {time.monotonic() - t_start:.0f} s")
    print_tables(results, ks, variants, probe=not args.no_probe, bypass_chains=args.bypass_chains)
    return 0


if __name__ == "__main__":
    sys.exit(main())
