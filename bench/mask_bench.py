"""Masked LoRAs side by side in one process: the pack's masks against its unmasked stack, ComfyUI's hook LoRAs on two
masked conditionings, and the pack's LoRAConditioningStrengths on two regions.

Run it with ComfyUI's python (it loads ComfyUI and this pack in-process; nothing is mocked):

    ~/comfy/ComfyUI/.venv/bin/python bench/mask_bench.py                      # Flux at Flux-dev width and SD1.5
    ~/comfy/ComfyUI/.venv/bin/python bench/mask_bench.py --models sd15 --ks 2  # --steps, --tokens, --size, ...

Models (tools/quant_bases.py, fp32 files through UNETLoader): ComfyUI's Flux at Flux-dev's width (hidden 3072,
1 double + 1 single block, random weights; 64 image + 16 text tokens) with k rank-32 kohya LoRAs on every block
Linear, and the synthetic SD1.5 checkpoint (64×64) with its kohya, PEFT, LoCon and a second kohya file. Two subjects:
the left and the right half of the latent; the stack's entries go to them in turn (entry 1 left, 2 right, 3 left...).
Every sampling is Euler, cfg 2 (a negative beside the prompt), one seed.

Methods, for k = 2 and 4, one after another on the same loaded base:
  plain      the stack unmasked (LoRAStack → MultiLoRALoader), one prompt
  masked     the same stack, each entry masked to its subject (LoRAStackMask), one prompt
  hooks      ComfyUI's hook LoRAs: the prompt twice, masked to each subject (ConditioningSetMask's call) with its
             entries as a hook group (CreateHookLora's), on the base model: one model call per hook group
  regions    the stack at strength 0 and the prompt twice, masked to each subject, each setting its entries'
             strengths (LoRAConditioningStrengths): one call per step, a region's worth of compute per subject
  auto       the stack with each entry's region found from the attention (LoRAAutoRegions' finder, its words two
             text tokens of the prompt, find_until 0.4): steps 0 and 1 recorded, the regions applied from step 2
Columns: plain's median step, and each method's median step over it (the first step is left out: ComfyUI loads and
patches before it; for auto, the median of the steps after find_until, and in brackets its recorded step 1),
the whole run in seconds (nodes, load and sampling, with the LoRA files already in the pack's cache and the OS's),
and the model calls per step with their batch sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import machine_line  # noqa: E402  (bench/ is on sys.path when a script runs)
from tools import quant_bases as qb  # noqa: E402
from tools import synth  # noqa: E402
from tools.comfy_inprocess import find_comfy, import_engine, import_node_module  # noqa: E402

METHODS = ("plain", "masked", "hooks", "regions", "auto")
UNTIL = 0.4
STRENGTHS = (0.8, 0.6, -0.5, 0.7)
CFG = 2.0


class Bench:
    """The methods side by side on each model: `build` makes a method's model and conditionings, `cell` times it."""

    METHODS = METHODS

    def __init__(self, host: qb.Host, args):
        self.host, self.args = host, args
        self.nodes = {"stack": import_node_module("stack").LoRAStack, "loader": import_node_module("loader")
                      .MultiLoRALoader, "mask": import_node_module("masks").LoRAStackMask,
                      "cond": import_node_module("conditioning").LoRAConditioningStrengths,
                      "entries": import_engine("stack.entry")}
        self.found = import_engine("found")
        self.calls: list[int] = []
        self.rows: list[dict] = []

    def run_model(self, spec) -> None:
        host, torch = self.host, self.host.torch
        spec.prepare(host)
        base_path = host.cache / (f"quant_flux_h{spec.hidden}_d{spec.depth}_s{spec.single}_seed{spec.seed}"
                                  ".safetensors" if isinstance(spec, qb.Flux) else
                                  f"quant_sd15_unet_of_{Path(spec.checkpoint).stem}.safetensors")
        if not base_path.exists():
            spec.write_base(host, base_path)
        base = host.load(qb.REFERENCE, base_path, spec.arch)
        base.model.diffusion_model.register_forward_pre_hook(lambda _m, a: self.calls.append(a[0].shape[0]))
        names = spec.write_loras(host, base, max(self.args.ks))
        noise = spec.inputs["noise"]
        h, w = noise.shape[-2:]
        left = torch.zeros(1, h, w)
        left[..., : w // 2] = 1.0
        self.sides = (left, 1.0 - left)
        self.negative = [[torch.zeros_like(c), {k: torch.zeros_like(v) if torch.is_tensor(v) else v
                                                for k, v in extra.items()}] for c, extra in spec.inputs["positive"]]
        self.prompt = spec.inputs["positive"]
        self.sample(spec, base)  # warm: the first load done
        for k in self.args.ks:
            stack = list(zip(names[:k], STRENGTHS[:k]))
            for method in self.METHODS:  # warm: every file read, by the pack's cache and ComfyUI's hooks alike
                self.sample(spec, *self.build(method, base, stack))
            cells = {m: self.cell(spec, m, base, stack) for m in self.METHODS}
            plain = cells["plain"]["step"]
            for c in cells.values():
                c["ratio"] = c["step"] / plain
            self.rows.append({"model": spec.label, "k": k, "cells": cells})
            print(format_row(self.rows[-1], self.METHODS), flush=True)
        host.unload()

    def build(self, method: str, base, stack):
        """(the model, the positive, the negative) of one method."""
        n = self.nodes
        if method in ("plain", "masked", "regions", "auto"):
            items = None
            for name, s in stack:
                items = n["stack"]().stack(name, 0.0 if method == "regions" else s, 0.0, lora_stack=items)[0]
            if method == "masked":
                for j, (name, _) in enumerate(stack):
                    items = n["mask"]().mask(items, name, self.sides[j % 2], 0.0, False, 0.0, 0.0)[0]
            if method == "auto":
                items = self.finder_of(items)
            model = n["loader"]().apply(base, items)[0]
        else:
            model = base
        if method in ("plain", "masked", "auto"):
            positive = self.prompt
        else:
            positive = []
            for side in (0, 1):
                own = [(name, s, 0.0) for j, (name, s) in enumerate(stack) if j % 2 == side]
                cond = self.host.comfy.hooks.set_mask_for_conditioning(self.prompt, self.sides[side], "default", 1.0)
                if method == "hooks":
                    cond = self.host.comfy.hooks.set_hooks_for_conditioning(cond, self.hook_group(own))
                else:
                    cond = n["cond"]().apply(cond, own, "keep")[0]
                positive += cond
        return model, positive, self.negative

    def finder_of(self, items):
        """The stack with every entry's region found as it samples: entry j's words are text token 1 or 2 (by its
        subject), as LoRAAutoRegions finds them in a tokenized prompt."""
        F, st = self.found, self.nodes["entries"]
        entries = st.entries(items)
        key = "t5xxl" if "guidance" in self.prompt[0][1] else "l"  # Flux reads T5 tokens, SD1.5 CLIP-L ones
        subjects = [F.Subject(e.name, {key: (1 + j % 2,)}) for j, e in enumerate(entries)]
        finder = F.Finder(subjects, {key: self.prompt[0][0].shape[1]}, UNTIL, 0.3, 1.0)
        return st.as_stack([e.with_shaping(region=finder.region(j)) for j, e in enumerate(entries)])

    def hook_group(self, entries):
        comfy = self.host.comfy
        group = comfy.hooks.HookGroup()
        for name, s, _ in entries:
            sd = comfy.utils.load_torch_file(str(self.host.folder("loras") / name), safe_load=True)
            for hook in comfy.hooks.create_hook_lora(sd, s, 0.0).get_type(comfy.hooks.EnumHookType.Weight):
                group.add(hook)
        return group

    def sample(self, spec, model, positive=None, negative=None, marks=None):
        host = self.host
        noise = spec.inputs["noise"]
        callback = (lambda *a: marks.append(time.perf_counter())) if marks is not None else None
        return host.comfy.sample.sample(model, noise, self.args.steps, CFG, "euler", "simple",
                                        positive or self.prompt, negative or self.negative,
                                        host.torch.zeros_like(noise), disable_pbar=True, seed=7, callback=callback)

    def cell(self, spec, method: str, base, stack) -> dict:
        marks: list[float] = []
        self.calls.clear()
        t0 = time.perf_counter()
        model, positive, negative = self.build(method, base, stack)
        self.sample(spec, model, positive, negative, marks)
        wall = time.perf_counter() - t0
        steps = [b - a for a, b in zip(marks, marks[1:])]
        per_step = len(self.calls) // self.args.steps
        found = round(UNTIL * self.args.steps)  # the first step with the regions; steps[i] is step i + 1's
        applied = steps[found - 1:] if method == "auto" else steps
        return {"step": statistics.median(applied), "recorded": steps[0], "run": wall,
                "calls": self.calls[:per_step]}


def format_row(row, methods=METHODS) -> str:
    c = row["cells"]
    recording = f" ({c['auto']['recorded'] / c['plain']['step']:.2f})" if "auto" in methods else ""
    return (f"| {row['model']} | {row['k']} | {1000 * c['plain']['step']:.0f} | "
            + " / ".join(f"{c[m]['ratio']:.2f}" for m in methods) + recording + " | "
            + " / ".join(f"{c[m]['run']:.1f}" for m in methods) + " | "
            + " / ".join("+".join(str(b) for b in c[m]["calls"]) for m in methods) + " |")


HEADER = ("| model | k | plain step ms | step / plain step: plain / masked / hooks / regions / auto (recording) | "
          "run s: plain / masked / hooks / regions / auto | model calls per step (batch sizes): plain / masked / "
          "hooks / regions / auto |\n"
          "|---|---|---|---|---|---|")


def run(doc: str, bench_class, header: str) -> int:
    """Parse the command line, and run `bench_class`'s methods on each model asked for; print the table."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder (default $COMFYUI_PATH, else ~/comfy/ComfyUI)")
    ap.add_argument("--models", default="flux,sd15", help="flux, sd15 or flux,sd15 (default both)")
    ap.add_argument("--ks", default="2,4", help="LoRAs per stack (default 2,4)")
    ap.add_argument("--steps", type=int, default=5, help="sampling steps per run (default 5: four timed steps)")
    ap.add_argument("--hidden", type=int, default=3072, help="Flux width (default 3072, Flux-dev's)")
    ap.add_argument("--tokens", type=int, default=64, help="Flux image tokens, a square number (default 64)")
    ap.add_argument("--txt-tokens", type=int, default=16, help="Flux text tokens (default 16)")
    ap.add_argument("--size", type=int, default=64, help="SD1.5 image side in pixels (default 64)")
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    comfy_root = find_comfy(args.comfy)
    started = time.monotonic()
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="multilora-bench-"))
    host = qb.Host(comfy_root, work, synth.default_cache_dir())
    import comfyui_version
    print(f"machine: {machine_line()}; ComfyUI {comfyui_version.__version__}, torch {host.torch.__version__}, "
          f"{host.torch.get_num_threads()} threads", flush=True)
    bench = bench_class(host, args)
    for name in args.models.split(","):
        if name == "flux":
            spec = qb.Flux(hidden=args.hidden, tokens=args.tokens, txt_tokens=args.txt_tokens)
        elif name == "sd15":
            assets = synth.ensure_assets(comfy_root=comfy_root, python=sys.executable)
            loras = {f"sd15_{kind}.safetensors": path for kind, path in assets["loras"].items()}
            loras["sd15_kohya_b.safetensors"] = str(synth.cached_lora("kohya", seed=404, rank=4))
            spec = qb.SD15(assets["checkpoint"], loras, size=args.size)
        else:
            sys.exit(f"--models: flux or sd15, got {name!r}")
        bench.run_model(spec)
    print("\n" + header)
    for row in bench.rows:
        print(format_row(row, bench.METHODS))
    print(f"\nwhole run {time.monotonic() - started:.0f} s; machine at the end: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(run(__doc__, Bench, HEADER))
