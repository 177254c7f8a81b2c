"""The per-step cost of a strength schedule and of block weights, on one real ComfyUI server, side by side:
ours with a constant strength, ours with a schedule that changes every step, ours with block weights,
and ComfyUI's own hook keyframes (CreateHookLora + CreateHookKeyframesInterpolated) on the same model.

    python bench/schedule_bench.py                       # synthetic SD1.5, 64×64, 8 steps, 3 runs each, CPU
    python bench/schedule_bench.py --steps 20 --repeat 5

Every variant runs once to warm up, then `--repeat` times with a new seed each time (so ComfyUI re-samples
but keeps its loaded, patched models). The table gives the median seconds of a run and the extra time per
step against our constant strength. The variants alternate on one base model, so the stock loader and
the hook keyframes also pay ComfyUI's re-patching whenever their turn comes (the hooks at every step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grid_bench import base_graph, synthetic_server  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from tools import synth  # noqa: E402

LORA = synth.LORA_NAMES["kohya"]


def graph(size: int, steps: int, seed: int, model, clip) -> dict:
    return base_graph(size, steps, model, clip, ["4", 0], "schedule_bench", seed=seed)


def variant(name: str, size: int, steps: int, seed: int) -> dict:
    if name == "base":
        return graph(size, steps, seed, ["1", 0], ["1", 1])
    if name == "stock LoraLoaderModelOnly":
        g = graph(size, steps, seed, ["20", 0], ["1", 1])
        g["20"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": LORA,
                                                                   "strength_model": 1.0}}
        return g
    if name == "ComfyUI hook keyframes":
        g = graph(size, steps, seed, ["1", 0], ["23", 0])
        g["20"] = {"class_type": "CreateHookLora", "inputs": {"lora_name": LORA, "strength_model": 1.0,
                                                              "strength_clip": 0.0}}
        g["21"] = {"class_type": "CreateHookKeyframesInterpolated", "inputs": {
            "strength_start": 1.0, "strength_end": 0.0, "interpolation": "linear", "start_percent": 0.0,
            "end_percent": 1.0, "keyframes_count": steps, "print_keyframes": False}}
        g["22"] = {"class_type": "SetHookKeyframes", "inputs": {"hooks": ["20", 0], "hook_kf": ["21", 0]}}
        g["23"] = {"class_type": "SetClipHooks", "inputs": {"clip": ["1", 1], "apply_to_conds": True,
                                                            "schedule_clip": False, "hooks": ["22", 0]}}
        return g
    g = graph(size, steps, seed, ["30", 0], ["1", 1])
    g["20"] = {"class_type": "LoRAStack", "inputs": {"lora_name": LORA, "strength_model": 1.0, "strength_clip": 0.0}}
    last = "20"
    if name == "ours, schedule 1→0 (every step)":
        g["21"] = {"class_type": "LoRAStrengthSchedule", "inputs": {"lora_stack": ["20", 0], "entry": "",
                                                                    "keyframes": "0:1, 1:0", "interpolation": "linear"}}
        last = "21"
    if name == "ours, block weights (NO-MID, OUT05=0.5)":
        g["21"] = {"class_type": "LoRABlockWeights", "inputs": {"lora_stack": ["20", 0], "entry": "",
                                                                "preset": "custom", "weights": "MID=0, OUT05=0.5"}}
        last = "21"
    g["30"] = {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "lora_stack": [last, 0],
                                                           "max_loras": 0}}
    return g


VARIANTS = ("base", "ours, constant strength", "ours, schedule 1→0 (every step)",
            "ours, block weights (NO-MID, OUT05=0.5)", "stock LoraLoaderModelOnly", "ComfyUI hook keyframes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    server = synthetic_server()
    if server is None:
        return 2
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for v in VARIANTS:
            server.run(variant(v, args.size, args.steps, 0), timeout=3600)  # warm: loaded and patched
        for r in range(args.repeat):  # interleaved, so that load drifts hit every variant alike
            for v in VARIANTS:
                t0 = time.monotonic()
                server.run(variant(v, args.size, args.steps, 1 + r), timeout=3600)
                times[v].append(time.monotonic() - t0)
    finally:
        server.stop()
    med = {v: statistics.median(t) for v, t in times.items()}
    ref = med["ours, constant strength"]
    print(machine_line())
    print(f"SD1.5-shaped synthetic model, {args.size}x{args.size}, {args.steps} steps, cfg 5, median of "
          f"{args.repeat} runs")
    print(f"{'variant':<42} {'s / run':>8} {'ms / step vs ours constant':>28}")
    for v in VARIANTS:
        print(f"{v:<42} {med[v]:8.2f} {1000 * (med[v] - ref) / args.steps:+28.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
