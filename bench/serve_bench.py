"""Serving on Ray Serve, side by side in one run: routed by files, by affinity key, by load, and every stack warm.

    python bench/serve_bench.py                      # 120 prompts, 24 LoRAs, two CPU workers; then prefetch
    python bench/serve_bench.py --workers 8 --arms "files,no ids,all warm"   # on a machine with room for eight
    python bench/serve_bench.py --prompts 200 --rank 64 --out serve.json

One seeded trace: each prompt a stack of 1 to 3 of `--loras` synthetic SD1.5 LoRAs (kohya, rank `--rank`, drawn
Zipf-like, exponent `--zipf`) on the synthetic checkpoint, 64×64, `--steps` steps; arrivals Poisson at `--load` of
the workers' capacity, measured first (prompts per second of one warm stack, one in flight per worker). The arms,
each on a fresh local Ray with `--workers` fresh workers (two by default; each CPU worker holds the synthetic SD1.5
at about 5 GB) whose base model is loaded before the trace starts:
- `files`: serve/'s ingress as it is, the pack's router (`serve/router.py`); `files slack 1` the same with slack 1;
- `affinity`: each prompt's affinity key as its multiplexed_model_id, Ray's own router;
- `no ids` (`--routing load`): Ray routes by load alone;
- `all warm`: by load, and every worker's cache (made large enough) holding every LoRA before the trace: the limit.
Per arm: LoRA files read and base models loaded per 100 prompts (the workers' cache misses and reads ahead;
"model_type" lines in their logs), the reads beyond the first read of each file the trace names (no router avoids
those: the workers start with no LoRA), p50 and p95 latency (send to image), of which the median wait (send to the
worker's start) and run (start to finish, reads of its own files included; ComfyUI's history stamps), throughput.
`--repeat N` runs the arms in turn N times, so that the spread between runs shows beside the gaps between arms.
Then, on one server, what one cold LoRA file costs a prompt (`cold`), and prefetch: two prompts with different cold
stacks posted back to back, the time from the second's post to its image, with and without
$MULTILORA_PREFETCH, and the LoRA files the second read itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402


def graph(stack, seed: int, steps: int, prefix: str = "serve") -> dict:
    """Checkpoint → a LoRAStack chain → MultiLoRALoader (model and clip) → KSampler, 64×64."""
    p = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}}}
    prev = None
    for j, (name, strength) in enumerate(stack):
        inputs = {"lora_name": name, "strength_model": strength, "strength_clip": strength}
        if prev:
            inputs["lora_stack"] = [prev, 0]
        p[f"s{j}"] = {"class_type": "LoRAStack", "inputs": inputs}
        prev = f"s{j}"
    model, clip = (["ml", 0], ["ml", 1]) if stack else (["1", 0], ["1", 1])
    if stack:
        p["ml"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "clip": ["1", 1],
                                                               "lora_stack": [prev, 0]}}
    p.update({
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": f"a served image {seed}"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "blurry"}},
        "7": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": model, "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "seed": seed,
            "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    })
    return p


def make_trace(n: int, names: list[str], zipf: float, seed: int) -> list[list[tuple[str, float]]]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf for i in range(len(names))]
    out = []
    for _ in range(n):
        k = rng.randint(1, 3)
        picked: list[str] = []
        while len(picked) < k:
            name = rng.choices(names, weights)[0]
            if name not in picked:
                picked.append(name)
        out.append([(name, round(rng.uniform(0.3, 1.0), 2)) for name in picked])
    return out


def http(url: str, body: dict | None = None, timeout: float = 900.0):
    """(status, JSON answer) of a request; `/generate` waits for the image, hence the timeout."""
    status, out = cs.fetch(url, body, timeout)
    return status, out if isinstance(out, dict) else {}


def ran_at(ingress: str, prompt_id: str | None) -> tuple[float, float] | None:
    """When a prompt's worker started and finished running it (epoch seconds, from its ComfyUI history)."""
    entry = http(f"{ingress}/history/{prompt_id}")[1].get(prompt_id, {}) if prompt_id else {}
    stamps = {kind: data.get("timestamp") for kind, data in entry.get("status", {}).get("messages", [])}
    if stamps.get("execution_start") is None or stamps.get("execution_success") is None:
        return None
    return stamps["execution_start"] / 1000, stamps["execution_success"] / 1000


def reads(url: str) -> int:
    """LoRA files a worker has read: its prompts' own reads (the cache's misses) and its reads ahead (prefetch)."""
    status = http(url + "/multilora/status")[1]
    return status["cache"]["misses"] + status["prefetch"]["read"]


def base_loads(workdir: Path) -> int:
    return sum((d / "comfyui.log").read_text(errors="replace").count("model_type ")
               for d in workdir.iterdir() if (d / "comfyui.log").is_file())


ROUTING = {"files": ("files", 0), "files slack 1": ("files", 1), "affinity": ("affinity", 0), "no ids": ("load", 0),
           "all warm": ("load", 0)}


def arm(name: str, args, trace, models: Path, rate: float | None, warm: list[str]) -> dict:
    """One arm on a fresh local Ray with `args.workers` fresh workers; with `rate` None, the calibration of the workers'
    throughput instead."""
    import ray
    from ray import serve

    from serve.app import build
    from serve.worker import WorkerSettings, launch_env

    root = cs.find_comfy_root()
    python = cs.find_comfy_python(root)
    work = Path(tempfile.mkdtemp(prefix=f"serve-bench-{name.replace(' ', '-')}-"))
    flags, env = cs.ComfyServer(comfy_root=root, python=python, models_dir=models, workdir=work / "flags").worker_flags()
    env = {**launch_env(), **env}
    if warm:
        env["MULTILORA_CACHE_MAX_ITEMS"] = str(len(warm) + 8)
    settings = WorkerSettings(workdir=str(work / "workers"), comfy_path=str(root), python=python,
                              args=(*flags, *cs.pinned_cache(root)), env=env)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = cs.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        routing, slack = ROUTING.get(name, ("load", 0))
        serve.run(build(settings, workers=args.workers, routing=routing, slack=slack), name="multilora",
                  route_prefix="/")
        ingress = f"http://127.0.0.1:{port}"
        urls = {d.name: (d / "url").read_text().strip() for d in (work / "workers").iterdir()}
        for url in urls.values():  # each worker's base model loaded (and, for `all warm`, every LoRA read)
            srv = cs.ComfyServer.attach(url)
            srv.wait(srv.post_prompt(graph([(n, 0.5) for n in warm], 0, 1)), timeout=1800)
        if rate is None:  # calibration: one prompt of one warm stack in flight per worker at all times, all busy
            stack = trace[0]
            http(ingress + "/generate", {"prompt": graph(stack, 0, args.steps)})
            t0 = time.monotonic()
            n = 4 * args.workers
            with ThreadPoolExecutor(max_workers=args.workers) as pool:
                list(pool.map(lambda i: http(ingress + "/generate", {"prompt": graph(stack, i, args.steps)}), range(n)))
            return {"throughput_per_s": n / (time.monotonic() - t0)}
        read0, loads0 = sum(reads(u) for u in urls.values()), base_loads(work / "workers")
        rng = random.Random(args.seed + 1)
        arrivals, t = [], 0.0
        for _ in trace:
            arrivals.append(t)
            t += rng.expovariate(rate)
        results = []
        start = time.monotonic()

        def send(i: int, stack):
            time.sleep(max(0.0, start + arrivals[i] - time.monotonic()))
            t0, wall = time.monotonic(), time.time()
            status, out = http(ingress + "/generate", {"prompt": graph(stack, 1000 + i, args.steps)})
            done = time.monotonic()
            ran = ran_at(ingress, out.get("prompt_id")) if status == 200 else None
            results.append({"latency": done - t0, "done": done, "ok": status == 200, "worker": out.get("worker"),
                            "wait_run": ran and (ran[0] - wall, ran[1] - ran[0])})

        with ThreadPoolExecutor(max_workers=64) as pool:
            list(pool.map(lambda a: send(*a), enumerate(trace)))
        lat = sorted(r["latency"] for r in results if r["ok"])
        split = [r["wait_run"] for r in results if r["wait_run"]]
        span = max(r["done"] for r in results) - start
        read = sum(reads(u) for u in urls.values()) - read0
        loads = base_loads(work / "workers") - loads0
        n = len(trace)
        first = 0 if warm else len({f for stack in trace for f, _ in stack})
        return {"arm": name, "ok": len(lat), "failed": n - len(lat),
                "lora_reads_per_100": round(100 * read / n, 1), "beyond_first_per_100": round(100 * (read - first) / n, 1),
                "base_loads_per_100": round(100 * loads / n, 1),
                "p50_s": round(statistics.median(lat), 2), "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 2),
                "wait_p50_s": round(statistics.median(w for w, _ in split), 2) if split else None,
                "run_p50_s": round(statistics.median(r for _, r in split), 2) if split else None,
                "throughput_per_min": round(60 * len(lat) / span, 2),
                "per_worker": {w: sum(1 for r in results if r["worker"] == w) for w in urls}}
    finally:
        serve.shutdown()
        ray.shutdown()


def prefetch_arm(on: bool, models: Path, pairs, steps: int) -> dict:
    """Per pair: prompt 1 posted, prompt 2 posted at once; the time from the second post to its image, and the files
    the second read itself (cache misses between its start, after the first finished, and its end)."""
    root = cs.find_comfy_root()
    srv = cs.ComfyServer(comfy_root=root, python=cs.find_comfy_python(root), models_dir=models,
                         extra_args=cs.pinned_cache(root), env={"MULTILORA_PREFETCH": "1" if on else "0"})
    srv.start()
    try:
        srv.run(graph([], 0, 1))  # the base model loaded
        times, own_reads = [], []
        for i, (first, second) in enumerate(pairs):
            p1 = srv.post_prompt(graph(first, 2 * i, steps))
            t0 = time.monotonic()
            p2 = srv.post_prompt(graph(second, 2 * i + 1, steps))
            srv.wait(p1, timeout=1800)
            m1 = srv.get_json("/multilora/status")["cache"]["misses"]
            srv.wait(p2, timeout=1800)
            times.append(time.monotonic() - t0)
            own_reads.append(srv.get_json("/multilora/status")["cache"]["misses"] - m1)
        return {"prefetch": on, "second_image_s": [round(t, 2) for t in times],
                "median_s": round(statistics.median(times), 2), "files_the_second_read": own_reads}
    finally:
        srv.cleanup()


def cold_cost(models: Path, names: list[str], steps: int, repeat: int = 3) -> dict:
    """What reading one LoRA file costs a prompt: a one-LoRA prompt on a file this server never read (a fresh copy),
    then the same prompt with another seed, warm; the median difference (bench/serve_sim.py takes it as the cold-load cost)."""
    import shutil
    root = cs.find_comfy_root()
    srv = cs.ComfyServer(comfy_root=root, python=cs.find_comfy_python(root), models_dir=models,
                         extra_args=cs.pinned_cache(root))
    srv.start()
    try:
        srv.run(graph([], 0, 1))
        cold, warm = [], []
        for i in range(repeat):
            name = f"cold_copy_{i}.safetensors"
            shutil.copyfile(models / "loras" / names[i], models / "loras" / name)
            for into, seed in ((cold, 2 * i), (warm, 2 * i + 1)):  # another seed: ComfyUI's cache serves no output
                t0 = time.monotonic()
                srv.run(graph([(name, 0.7)], seed, steps))
                into.append(time.monotonic() - t0)
        return {"cold_s": round(statistics.median(cold), 3), "warm_s": round(statistics.median(warm), 3),
                "file_s": round(statistics.median(c - w for c, w in zip(cold, warm)), 3)}
    finally:
        srv.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--workers", type=int, default=2, help="ComfyUI workers in each routing arm")
    ap.add_argument("--loras", type=int, default=24)
    ap.add_argument("--rank", type=int, default=64,
                    help="rank of the synthetic LoRAs (64: 44.7 MiB each on the synthetic SD1.5)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the workers' capacity")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="run the routing arms in turn this many times")
    ap.add_argument("--arms", default="files,no ids,all warm,cold,prefetch",
                    help=f"of {', '.join([*ROUTING, 'cold', 'prefetch'])}")
    ap.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()
    root = cs.find_comfy_root()
    if root is None:
        print("no ComfyUI found: set COMFYUI_PATH", file=sys.stderr)
        return 2
    python = cs.find_comfy_python(root)
    assets = synth.ensure_assets_any_python(comfy_root=root, python=python)
    manifest = synth.shape_manifest(comfy_root=root, python=python)
    models = Path(tempfile.mkdtemp(prefix="serve-bench-models-"))
    for sub in cs.MODEL_SUBDIRS:
        (models / sub).mkdir()
    (models / "checkpoints" / synth.CHECKPOINT_NAME).symlink_to(assets["checkpoint"])
    names = []
    for i in range(args.loras):
        src = synth.cached_lora(kind="kohya", seed=7000 + i, rank=args.rank, manifest=manifest)
        names.append(f"bench_{i:02d}.safetensors")
        os.link(src, models / "loras" / names[-1])
    print(f"{args.loras} LoRAs of {os.path.getsize(models / 'loras' / names[0]) / 2**20:.1f} MiB; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    trace = make_trace(args.prompts, names, args.zipf, args.seed)
    figures = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "arms": []}
    arms = [a.strip() for a in args.arms.split(",")]
    if set(arms) & set(ROUTING):
        capacity = arm("calibration", args, trace, models, None, warm=[])["throughput_per_s"]
        rate = args.load * capacity
        figures["capacity_per_s"], figures["arrivals_per_s"] = round(capacity, 3), round(rate, 3)
        print(f"{args.workers} workers busy with one warm stack: {capacity:.3f} prompts/s; arrivals {rate:.3f}/s "
              f"({args.load:.0%})", flush=True)
        for round_ in range(1, args.repeat + 1):  # the arms in turn, `--repeat` times: the spread between rounds
            for name in ROUTING:
                if name in arms:
                    row = arm(name, args, trace, models, rate,
                              warm=sorted({n for stack in trace for n, _ in stack}) if name == "all warm" else [])
                    figures["arms"].append({**row, "round": round_})
                    print(json.dumps(figures["arms"][-1]), flush=True)
    if "cold" in arms:
        figures["cold_load"] = cold_cost(models, names, args.steps)
        print(json.dumps({"cold_load": figures["cold_load"]}), flush=True)
    if "prefetch" in arms:
        pairs = [([(names[6 * i + j], 0.7) for j in range(3)], [(names[6 * i + 3 + j], 0.7) for j in range(3)])
                 for i in range(min(4, args.loras // 6))]
        figures["prefetch"] = [prefetch_arm(on, models, pairs, max(args.steps, 6)) for on in (False, True)]
        for row in figures["prefetch"]:
            print(json.dumps(row), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
