"""LoRAs on quantized bases, side by side in one process: this pack against ComfyUI's stock and bypass loaders.

Run it with ComfyUI's python (it loads ComfyUI, this pack and ComfyUI-GGUF in-process; nothing is mocked):

    ~/comfy/ComfyUI/.venv/bin/python bench/quant_bench.py                       # Flux, fp8_e4m3fn and GGUF Q8_0
    ~/comfy/ComfyUI/.venv/bin/python bench/quant_bench.py --models flux,sd15 --storages all   # every variant
    ~/comfy/ComfyUI/.venv/bin/python bench/quant_bench.py --help                # --ks, --steps, --tokens, ...

Models: ComfyUI's Flux at Flux-dev's width (hidden 3072, 1 double + 1 single block, random weights; 16 image + 8
text tokens) and the synthetic SD1.5 checkpoint of tools/synth.py (64×64). Storages (tools/quant_bases.py): UNETLoader
with weight_dtype fp8_e4m3fn and fp8_e5m2; ComfyUI's mixed-precision files (comfy/quant_ops.py) in each format of
QUANT_ALGOS, the block Linears quantized; GGUF Q8_0 and Q4_K through ComfyUI-GGUF's UnetLoaderGGUF. The files are
written once from the full-precision weights into the synthetic files' cache. LoRAs: Flux, k rank-32 kohya files
on every block Linear; SD1.5, the synthetic kohya, PEFT and LoCon files and a second kohya file.

For each model, storage, k and path (ours: LoRAStack → MultiLoRALoader; stock: LoraLoaderModelOnly chain; bypass:
LoraLoaderBypassModelOnly, composed for k > 1), in one process, one cell after another:
  first run  the path's nodes on the loaded base (the pack's cache emptied, new node instances: every path reads its
             files) and a sampling of --steps steps (Euler, cfg 1), wall time; in brackets the part before the
             first step (nodes, ComfyUI's load: patching, injecting, activating), the end of step 1 less one step
  re-run     the last LoRA's strength moved, the same node instances run again, and a sampling: ComfyUI unpatches
             and patches again (stock), ejects and injects (bypass), writes a strength (ours)
  step       the median of the two runs' steps over the median of the base's steps, sampled just before the cell
  hooks      ours' own work in a step: the time spent in the pack's layer hooks over both samplings, per step, ms,
             and as a share of the base's median step (the rest of ours' step is the base's own work)
  faults     the process's minor page faults per step (the median over the same steps), in thousands, and the base's
             in brackets: memory the C library maps afresh for a step's temporaries (a dequantized weight) and the
             kernel fills with zeros on first touch, where the heap has no free block that holds them
  peak       the process's peak resident memory over the cell (VmHWM, reset as the cell starts, after glibc handed
             back its free memory; blocks of 1 MiB or more are mapped on their own, unless --steady-heap) less its
             resident size then, MB
  error      the first run's image against the reference, the full-precision file (fp32 on the CPU) with the same
             LoRAs through the stock loader: the worst channel's mean |Δ| and the largest |Δ|, in levels of 1/255;
             "base" is the storage without LoRAs against the full-precision base; "effect" compares what the LoRAs
             change (the image less the storage's base image) with what they change on the reference

Before a storage's cells one cell of the first path and k runs unrecorded (--no-warmup: not): whichever path runs
first after the base's own steps was slower, in 10 of 12 first-run and re-run pairs measured without it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import machine_line  # noqa: E402  (bench/ is on sys.path when a script runs)
from save_memory import reset_peak, vm  # noqa: E402
from tools import quant_bases as qb  # noqa: E402
from tools import synth  # noqa: E402
from tools.comfy_inprocess import find_comfy, import_engine  # noqa: E402

PATHS = ("ours", "stock", "bypass")
STRENGTHS = (0.8, 0.6, -0.5, 0.7)
MOVED = 0.3  # the last LoRA's strength in the re-run
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters (malloc.h)


def libc(call: str, *args) -> None:
    """glibc's malloc_trim(0) (hand the heap's free memory back, so that the resident size at a cell's start is what
    is live) or mallopt (`heap`). Nothing where the C library is not glibc."""
    try:
        getattr(ctypes.CDLL("libc.so.6"), call)(*args)
    except (OSError, AttributeError):
        pass


def heap(steady: bool) -> None:
    """The C library's policy for the run. Default: blocks of 1 MiB or more mapped on their own and unmapped when
    freed (M_MMAP_THRESHOLD 1 MiB; by default the threshold grows with the blocks freed, and later tensors come from a
    heap that keeps its memory), so that a cell's peak is what it held. `steady`: nothing mapped on its own and no
    free memory handed back during a cell (M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB), so that a step's temporaries reuse
    the heap's free blocks and no step pays for fresh pages; a cell's peak then includes the heap's free blocks."""
    if steady:
        libc("mallopt", M_MMAP_MAX, 0)
        libc("mallopt", M_TRIM_THRESHOLD, 2**31 - 1)
    else:
        libc("mallopt", M_MMAP_THRESHOLD, 1 << 20)


class QuietStockKeys(logging.Filter):
    """ComfyUI logs one warning per LoRA key a model-only load leaves out (the SD1.5 files' text-encoder keys)."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def filter(self, record) -> bool:
        if str(record.msg).startswith("lora key not loaded"):
            self.dropped += 1
            return False
        return True


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def steps_of(marks) -> list[float]:
    return [b - a for a, b in zip(marks, marks[1:])]


def runs_steps(marks, steps: int) -> list[float]:
    """The steps after the first of two runs of `steps` steps each, from their marks in one list."""
    return steps_of(marks[:steps]) + steps_of(marks[steps:])


class Marks(list):
    """The end of each step (the sampler's callback appends the time) and, in `faults`, the process's minor page
    faults by then."""

    def __init__(self):
        super().__init__()
        self.faults: list[int] = []

    def append(self, t: float) -> None:
        super().append(t)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def stack_of(names, k: int, moved: bool = False) -> list[tuple[str, float]]:
    stack = list(zip(names[:k], STRENGTHS[:k]))
    if moved:
        stack[-1] = (stack[-1][0], MOVED)
    return stack


def specs(args, comfy_root) -> list:
    out = []
    for name in args.models.split(","):
        if name == "flux":
            out.append(qb.Flux(hidden=args.hidden, tokens=args.tokens, txt_tokens=args.txt_tokens))
        elif name == "sd15":
            assets = synth.ensure_assets(comfy_root=comfy_root, python=sys.executable)
            loras = {f"sd15_{kind}.safetensors": path for kind, path in assets["loras"].items()}
            loras["sd15_kohya_b.safetensors"] = str(synth.cached_lora("kohya", seed=404, rank=4))
            out.append(qb.SD15(assets["checkpoint"], loras, size=args.size))
        else:
            sys.exit(f"--models: flux or sd15, got {name!r}")
    return out


class HookClock:
    """The seconds spent in the pack's layer hooks (`LayerSlots._hook`, timed around each call): ours' own work in a
    step, apart from the base's, whose time the heap's page faults make vary (see `heap`)."""

    def __init__(self):
        self.seconds = 0.0
        slots = import_engine("layer").LayerSlots
        hook = slots._hook

        def timed(layer, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return hook(layer, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        slots._hook = timed  # before any layer is made: each registers its bound `_hook`


class Bench:
    def __init__(self, host: qb.Host, args):
        self.host, self.args = host, args
        self.rows: list[dict] = []
        self.hooks = HookClock()

    def base_file(self, spec) -> Path:
        if isinstance(spec, qb.Flux):
            name = f"quant_flux_h{spec.hidden}_d{spec.depth}_s{spec.single}_seed{spec.seed}.safetensors"
        else:
            name = f"quant_sd15_unet_of_{Path(spec.checkpoint).stem}.safetensors"
        path = self.host.cache / name
        if not path.exists():
            spec.write_base(self.host, path)
        return path

    def run_model(self, spec, storages) -> None:
        host, args = self.host, self.args
        spec.prepare(host)
        base_path = self.base_file(spec)
        ref_model = host.load(qb.REFERENCE, base_path, spec.arch)
        names = spec.write_loras(host, ref_model, max(args.ks))
        ref_base = spec.image(host, host.sample(spec, ref_model, args.steps))
        refs = {k: spec.image(host, host.sample(spec, host.apply("stock", ref_model, stack_of(names, k)),
                                                args.steps)) for k in args.ks}
        effects = {k: qb.image_error(refs[k], ref_base) for k in args.ks}
        print(f"\n{spec.label}: reference {base_path.name} (fp32); the LoRAs' own effect on its image, mean (max): "
              + ", ".join(f"k={k} {m:.2f} ({x:.1f})" for k, (m, x) in effects.items()), flush=True)
        del ref_model
        host.unload()
        for storage in storages:
            why = host.missing(storage)
            if why is None:
                try:
                    self.run_storage(spec, storage, base_path, names, ref_base, refs)
                except Exception as e:  # a storage this ComfyUI cannot run is a row of the table, not the end
                    why = f"{type(e).__name__}: {e}"
            if why is not None:
                print(f"{spec.label} {storage.name}: not run: {why}", flush=True)
                self.rows.append({"model": spec.label, "storage": storage.name, "skipped": why})
            host.unload()

    def run_storage(self, spec, storage, base_path, names, ref_base, refs) -> None:
        host, args = self.host, self.args
        t0 = time.perf_counter()
        file, note = host.storage_file(storage, base_path, spec.arch)
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        base = host.load(storage, base_path, spec.arch)
        base_img = spec.image(host, host.sample(spec, base, args.steps))
        loaded = time.perf_counter() - t0
        size = (host.folder("diffusion_models") / file).resolve().stat().st_size
        print(f"{spec.label} {storage.name}: {file} ({size / 2**20:.0f} MiB{'; ' + note if note else ''}); "
              f"written in {made:.1f} s, loaded and sampled in {loaded:.1f} s", flush=True)
        images = {k: (refs[k], ref_base, base_img) for k in args.ks}
        if args.warmup:  # not recorded: the first cell after the base's steps runs slower, whichever path it is
            self.cell(spec, base, args.paths[0], names, args.ks[0], images[args.ks[0]])
        cells = [self.cell(spec, base, path, names, k, images[k]) for k in args.ks for path in args.paths]
        err = qb.image_error(base_img, ref_base)
        self.rows.append({"model": spec.label, "storage": storage.name, "base_error": err, "cells": cells})
        for k in args.ks:
            print(format_row(spec.label, storage.name, k, err, [c for c in cells if c["k"] == k]), flush=True)

    def timed(self, spec, build, marks: list) -> tuple[float, float, object]:
        """(wall seconds, seconds before the first step, the image) of `build()` (the nodes) and a sampling of its
        model; the part before the first step is the end of step 1 less the median step (at least 0)."""
        host = self.host
        t0 = time.perf_counter()
        model = build()
        start = len(marks)
        samples = host.sample(spec, model, self.args.steps, marks)
        wall = time.perf_counter() - t0
        mine = marks[start:]
        return wall, max(0.0, mine[0] - t0 - median(steps_of(mine))), spec.image(host, samples)

    def cell(self, spec, base, path, names, k, images) -> dict:
        host, steps = self.host, self.args.steps
        ref, ref_base, base_img = images
        import_engine().default_cache().clear()  # the first run reads its files, as a new stock node does
        base_marks = Marks()
        host.sample(spec, base, steps, base_marks)  # the base's steps, next to this cell's
        gc.collect()
        libc("malloc_trim", 0)
        peaked = reset_peak(os.getpid())
        rss0 = vm(os.getpid(), "VmRSS")
        marks = Marks()
        hooked = self.hooks.seconds
        chain = host.chain(path, k)
        models = []  # both runs' models stay referenced, as ComfyUI's cache holds the first while the second loads

        def build(stack):
            models.append(host.apply(path, base, stack, chain))
            return models[-1]

        first, setup, img = self.timed(spec, lambda: build(stack_of(names, k)), marks)
        rerun, resetup, _ = self.timed(spec, lambda: build(stack_of(names, k, moved=True)), marks)
        peak = (vm(os.getpid()) - rss0) / 2**20 if peaked else float("nan")
        del models, chain
        host.unload()
        cell_steps, faults = runs_steps(marks, steps), runs_steps(marks.faults, steps)
        base_step = median(steps_of(base_marks))
        return {"k": k, "path": path, "first": first, "setup": setup, "rerun": rerun, "resetup": resetup,
                "ratio": median(cell_steps) / base_step, "peak": peak,
                "hooks": (self.hooks.seconds - hooked) / (2 * steps), "base_step": base_step,
                "faults": median(faults) / 1e3, "base_faults": median(steps_of(base_marks.faults)) / 1e3,
                "error": qb.image_error(img, ref), "effect_error": qb.image_error(img - base_img, ref - ref_base)}


def format_row(model, storage, k, base_err, cells) -> str:
    by = {c["path"]: c for c in cells}

    def cols(fmt) -> str:
        return " / ".join(fmt(by[p]) if p in by else "-" for p in PATHS)

    def err(key) -> str:
        return cols(lambda c: f"{c[key][0]:.2f} ({c[key][1]:.1f})")

    ours = by.get("ours")
    hooks = "-" if ours is None else f"{ours['hooks'] * 1e3:.0f} ({100 * ours['hooks'] / ours['base_step']:.1f} %)"
    return (f"| {model} | {storage} | {k} | {cols(lambda c: format(c['ratio'], '.2f'))} | {hooks} | "
            f"{cols(lambda c: '{:.1f} ({:.1f})'.format(c['first'], c['setup']))} | "
            f"{cols(lambda c: '{:.1f} ({:.2f})'.format(c['rerun'], c['resetup']))} | "
            f"{cols(lambda c: '{:.0f} ({:.0f})'.format(c['faults'], c['base_faults']))} | "
            f"{cols(lambda c: format(c['peak'], '.0f'))} | {base_err[0]:.2f} ({base_err[1]:.1f}) | "
            f"{err('error')} | {err('effect_error')} |")


HEADER = ("| model | storage | k | step / base: ours / stock / bypass | ours' hooks per step, ms (of the base's "
          "step) | first run s (before step 1) | re-run after a "
          "strength change s (before step 1) | page faults per step, k (base) | peak MB | base without LoRAs: error | "
          "image error: ours / stock / bypass | the LoRAs' effect: error |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder (default $COMFYUI_PATH, else ~/comfy/ComfyUI)")
    ap.add_argument("--gguf", help="ComfyUI-GGUF folder (default $COMFYUI_GGUF_PATH, else "
                    "<ComfyUI>/custom_nodes/ComfyUI-GGUF); without it the GGUF rows say why they did not run")
    ap.add_argument("--models", default="flux", help="flux, sd15 or flux,sd15 (default flux)")
    ap.add_argument("--storages", default="fp8_e4m3fn,gguf_q8_0", help="comma-separated storages or all; "
                    f"default fp8_e4m3fn,gguf_q8_0; all: {','.join(s.slug for s in qb.STORAGES)}")
    ap.add_argument("--ks", default="1,4", help="LoRAs per stack (default 1,4)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--steps", type=int, default=3, help="sampling steps per run (default 3: two timed steps)")
    ap.add_argument("--hidden", type=int, default=3072, help="Flux width (default 3072, Flux-dev's)")
    ap.add_argument("--tokens", type=int, default=16, help="Flux image tokens, a square number (default 16)")
    ap.add_argument("--txt-tokens", type=int, default=8, help="Flux text tokens (default 8)")
    ap.add_argument("--size", type=int, default=64, help="SD1.5 image side in pixels (default 64)")
    ap.add_argument("--cache", help="where the storage files are kept (default the synthetic files' cache)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="measure from the first cell of each storage on (default: one cell of the first path and "
                    "k is run first and not recorded)")
    ap.add_argument("--steady-heap", action="store_true",
                    help="the C library keeps freed memory for reuse and maps no block on its own (see heap()): the "
                    "step ratios without the page faults of temporaries mapped afresh, whose number follows the "
                    "heap's layout and changes from one sampling to the next")
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.paths = [p for p in args.paths.split(",") if p]
    storages = list(qb.STORAGES) if args.storages == "all" else [qb.storage_named(s) for s in args.storages.split(",")]
    comfy_root = find_comfy(args.comfy)
    started = time.monotonic()
    heap(args.steady_heap)
    gguf = Path(args.gguf or os.environ.get("COMFYUI_GGUF_PATH") or comfy_root / "custom_nodes" / "ComfyUI-GGUF")
    work = Path(tempfile.mkdtemp(prefix="multilora-quant-"))
    host = qb.Host(comfy_root, work, Path(args.cache) if args.cache else synth.default_cache_dir(), gguf.expanduser())
    quiet = QuietStockKeys()
    logging.getLogger().addFilter(quiet)  # ComfyUI logs them on the root logger
    import comfyui_version
    print(f"machine: {machine_line()}; ComfyUI {comfyui_version.__version__}, torch {host.torch.__version__}, "
          f"{host.torch.get_num_threads()} threads; heap: {'steady' if args.steady_heap else 'default'}; "
          f"ComfyUI-GGUF: {host.gguf_missing or gguf}", flush=True)
    bench = Bench(host, args)
    try:
        for spec in specs(args, comfy_root):
            bench.run_model(spec, storages)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + HEADER)
    for row in bench.rows:
        if "skipped" in row:
            print(f"| {row['model']} | {row['storage']} | - | not run: {row['skipped']} |")
            continue
        for k in args.ks:
            print(format_row(row["model"], row["storage"], k, row["base_error"],
                             [c for c in row["cells"] if c["k"] == k]))
    print(f"\nwhole run {time.monotonic() - started:.0f} s ({quiet.dropped} of ComfyUI's 'lora key not loaded' "
          f"warnings not shown); machine at the end: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
