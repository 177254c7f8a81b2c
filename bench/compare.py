"""Side by side in one process: our slot engine against ComfyUI's fused and bypass LoRA paths.

Run it with the ComfyUI python (it imports ComfyUI's own classes in-process; nothing is mocked):

    ~/comfy/ComfyUI/.venv/bin/python bench/compare.py                  # CPU, scaled-down Flux
    python3 bench/compare.py --comfy .comfy --device cuda --dtype bf16 --full   # Flux-dev shape (GPU)

The model is ComfyUI's Flux (comfy.model_base.Flux around comfy.ldm.flux.model.Flux, built from a
supported_models.Flux config) with random weights, wrapped in a ModelPatcher. On the CPU it is
scaled down (hidden 3072 / 24 heads as Flux-dev, 1 double + 1 single block, 256 image + 32 text
tokens by default: enough tokens that a step is bound by its arithmetic, as Flux-dev's 4608 tokens
are on a GPU, not by streaming the weights); --full builds Flux-dev's 19 double + 38 single blocks
(11.9 B parameters). For k = 1, 2, 4, 8 synthetic
rank-32 LoRAs with kohya keys from comfy.lora.model_lora_keys_unet on that model (every Linear of
every block), it measures:

  ours    lora_engine.SlotBank with ComfyUI's key map (as nodes/bridge/ builds it):
          step      a forward of the diffusion model with the bank active
          strength  bank.set_strength (the engine's cost of a slider move)
          strength† the same move the way ComfyUI runs it: MultiLoRALoader's apply_stack (new clone)
                    + load_models_gpu (eject the old clone, inject the new: re-activation)
          first     a fresh bank activating k adapters from the engine's warm cache
          swap      k other adapters replacing the k active ones in the bank's warm slots (how
                    a model's LoRAs change after its first run)
          memory    slot bytes on the device (no weight backups exist)
  fused   LoraLoader's path: comfy.sd.load_lora_for_models per LoRA (state dicts already read, as
          the node caches them), then comfy.model_management.load_models_gpu, which patches
          W + s*dW into the weights (ModelPatcher.patch_model) the way sampling does:
          step      a forward with the patched weights
          strength  the last LoRA re-applied at another strength (its node re-runs: a new clone) +
                    load_models_gpu: unpatch (restore every backup) and patch again
          first     the chain of k clones + load_models_gpu from the loaded base model
          memory    bytes of the weight backups ModelPatcher keeps (patcher.backup)
  bypass  LoraLoaderBypass's path: comfy.sd.load_bypass_lora_for_models + load_models_gpu, which
          injects ComfyUI's BypassForwardHook per layer (adapter weights moved to the device):
          step, strength, first as for fused; memory: adapter bytes moved to the device;
          swap: a model with k other LoRAs' injections loaded in place of the active one's.
          (The fused path's swap is an unpatch and a first application: not measured.)
          k > 1: a stock chain of LoraLoaderBypass nodes keeps only its last LoRA (each node
          replaces the "bypass_lora" injection list), so here each LoRA's own injection from
          load_bypass_lora_for_models is composed into one (injected in order, ejected in
          reverse): what a working chain costs.

Steps: ours and bypass alternate forwards without and with the adapters (bank.deactivate/activate,
ModelPatcher.eject_model/inject_model), --repeat pairs, and "step vs base" is the median of the
per-pair ratios, so load from other jobs moves both sides of each ratio; the fused path's steps
alternate the same way, its patched weights and ComfyUI's backups of the originals swapped by
reference (no copy). Strength changes: median of --repeat (set_strength: of 50). First
application: median of --repeat-apply for ours and bypass, of --repeat-apply-fused for the fused path
(seconds each). Ours writes into new slot buffers and bypass into new copies of the adapters in the
model's dtype; whether that memory is faulted in page by page or comes from what the allocator kept of
an earlier application changes from one application to the next, and on a CPU the first case costs
several times the second, so ours and bypass take the median of 5. Swaps: median of 3, alternating
between two sets of k.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK = 32


# -- ComfyUI in-process ------------------------------------------------------------------------------

from machine import machine_line  # noqa: E402  (bench/ is on sys.path when a script runs)
from tools.comfy_inprocess import (build_flux, entry_of, find_comfy, flux_lora_targets, flux_lora_tensors,
                                   import_bridge, import_comfy, import_engine)

# -- model and LoRAs ---------------------------------------------------------------------------------

def write_loras(torch, targets, n: int, rank: int, folder: str) -> list[str]:
    from safetensors.torch import save_file
    paths = []
    for i in range(n):
        path = os.path.join(folder, f"flux_lora_{i}.safetensors")
        save_file(flux_lora_tensors(torch, targets, 1000 + i, rank), path)
        paths.append(path)
    return paths


# -- timing ------------------------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def once(self, fn) -> float:
        return self.both(fn)[0]

    def both(self, fn) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of one call."""
        self.sync()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0, time.process_time() - c0

    def median(self, fn, repeat: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn) for _ in range(repeat))


class WeightSwap:
    """Toggles a fused model between its patched weights and ComfyUI's backups of the originals by swapping
    each parameter's storage (no copy), so that fused steps pair with base steps like the other paths'."""

    def __init__(self, comfy, root, backup):
        self.params = [comfy.utils.get_attr(root, key) for key in backup]
        # On a GPU the backups sit on the offload device: the base steps need them where the model computes.
        self.other = [b.weight.to(p.device) for p, b in zip(self.params, backup.values())]
        self.on_base = False

    def _flip(self) -> None:
        for i, p in enumerate(self.params):
            p.data, self.other[i] = self.other[i], p.data
        self.on_base = not self.on_base

    def base(self) -> None:
        if not self.on_base:
            self._flip()

    def patched(self) -> None:
        if self.on_base:
            self._flip()


def tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# -- the benchmark -----------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", help="ComfyUI folder (a checkout or a copy of comfy/ + folder_paths.py + "
                    "node_helpers.py); default $COMFYUI_PATH, else ~/comfy/ComfyUI, else ./.comfy")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--full", action="store_true", help="Flux-dev shape: 19 double + 38 single blocks, "
                    "1024x1024 (4096 image + 512 text tokens) unless --tokens/--txt-tokens say otherwise")
    ap.add_argument("--hidden", type=int, default=3072, help="hidden size (heads = hidden / 128); default 3072")
    ap.add_argument("--depth", type=int, default=None, help="double blocks (default 1; 19 with --full)")
    ap.add_argument("--single-depth", type=int, default=None, help="single blocks (default 1; 38 with --full)")
    ap.add_argument("--tokens", type=int, default=None, help="image tokens, a square number (default 256; "
                    "4096 with --full)")
    ap.add_argument("--txt-tokens", type=int, default=None, help="text tokens (default 32; 512 with --full)")
    ap.add_argument("--rank", type=int, default=RANK)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=9,
                    help="timed step pairs (base, with adapters) and strength changes per cell; medians (default 9)")
    ap.add_argument("--repeat-apply", type=int, default=5,
                    help="timed first applications per cell, ours and bypass (median; default 5)")
    ap.add_argument("--repeat-apply-fused", type=int, default=2,
                    help="timed first applications per cell, the fused path (median; default 2)")
    ap.add_argument("--paths", default="ours,fused,bypass")
    args = ap.parse_args()
    depth = args.depth if args.depth is not None else (19 if args.full else 1)
    single = args.single_depth if args.single_depth is not None else (38 if args.full else 1)
    tokens = args.tokens if args.tokens is not None else (4096 if args.full else 256)
    txt_tokens = args.txt_tokens if args.txt_tokens is not None else (512 if args.full else 32)
    side = math.isqrt(tokens)
    if side * side != tokens:
        ap.error("--tokens must be a square number")
    ks = [int(k) for k in args.ks.split(",")]
    paths = set(args.paths.split(","))
    t_start = time.monotonic()

    root_dir = find_comfy(args.comfy)
    comfy = import_comfy(root_dir, args.device)
    import torch
    mm = comfy.model_management
    engine = import_engine()  # the pack's, which the bridge uses
    AdapterCache, KeyMap, SlotBank = engine.AdapterCache, engine.KeyMap, engine.SlotBank
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = mm.get_torch_device()
    if args.device == "cuda" and device.type != "cuda":
        sys.exit(f"--device cuda, but ComfyUI picked {device}")
    timer = Timer(torch, device)
    try:
        import comfyui_version
        comfy_version = comfyui_version.__version__
    except ImportError:
        comfy_version = "?"

    print(f"machine: {machine_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    base = build_flux(comfy, torch, args.hidden, depth, single, dtype, device)
    root = base.model
    n_params = sum(p.numel() for p in root.parameters())
    targets = flux_lora_targets(comfy, torch, root)
    print(f"ComfyUI {comfy_version} at {root_dir}; model: comfy.ldm.flux.model.Flux, hidden {args.hidden}, "
          f"{args.hidden // 128} heads, {depth} double + {single} single blocks, {n_params / 1e9:.2f} B params, "
          f"{args.dtype} on {device}; step: {tokens} image + {txt_tokens} text tokens")
    tmp = tempfile.mkdtemp(prefix="multilora-compare-")
    atexit.register(shutil.rmtree, tmp, True)
    lora_paths = write_loras(torch, targets, 2 * max(ks), args.rank, tmp)  # k to apply, k to swap in
    lora_mb = os.path.getsize(lora_paths[0]) / 2**20
    print(f"LoRAs: {2 * max(ks)} synthetic (k to apply, k to swap in), rank {args.rank}, kohya keys on all "
          f"{len(targets)} block Linears, {lora_mb:.1f} MB each (bf16)")

    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, 16, 2 * side, 2 * side, generator=gen, device=device).to(dtype)
    context = torch.randn(1, txt_tokens, 4096, generator=gen, device=device).to(dtype)
    y = torch.randn(1, 768, generator=gen, device=device).to(dtype)
    t = torch.full((1,), 0.5, device=device)
    guidance = torch.full((1,), 3.5, device=device)

    def step():
        with torch.inference_mode():
            return root.diffusion_model(x, t, context, y=y, guidance=guidance)

    def paired(off, on, repeat):
        """Forwards alternating without and with the adapters (order flipped every pair): medians of each
        and of the per-pair ratio, so that load from other jobs moves both sides of each ratio."""
        off(), step(), on(), step()  # warm-up
        bases, steps, ratios, cpu_ratios = [], [], [], []
        for i in range(repeat):
            got = {}
            for phase in ((off, on) if i % 2 == 0 else (on, off)):
                phase()
                got[phase is on] = timer.both(step)
            bases.append(got[False][0])
            steps.append(got[True][0])
            ratios.append(got[True][0] / got[False][0])
            cpu_ratios.append(got[True][1] / got[False][1])
        on()
        return (statistics.median(bases), statistics.median(steps), statistics.median(ratios),
                statistics.median(cpu_ratios))

    # What LoraLoader / LoraLoaderBypass hold after their first run: the state dicts, read once.
    lora_sds = [comfy.utils.load_torch_file(p, safe_load=True) for p in lora_paths]
    # Our engine's process-wide cache, warm: the files are parsed once, as MultiLoRALoader does.
    cache = AdapterCache(max_items=2 * max(ks) + 1, max_bytes=1 << 40)
    adapters = [cache.load(p, name=os.path.basename(p), convert=comfy.lora_convert.convert_lora,
                           convert_id="comfy") for p in lora_paths]
    keymap = KeyMap(root, comfy.lora.model_lora_keys_unet(root, {}), defaults=False)  # as the bridge builds it
    bridge = import_bridge() if "ours" in paths else None

    def reset():
        """Unload everything (restores fused weights, ejects injections), then load the bare base model."""
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache()
        mm.load_models_gpu([base])

    reset()
    print(f"machine before measuring: {machine_line()}\n", flush=True)
    rows: dict[int, dict[str, float]] = {}
    for k in ks:
        r: dict[str, float] = {}
        ones = [1.0] * k
        values = iter([0.5, 0.75] * 100000)

        if "ours" in paths:
            reset()
            firsts = []
            for _ in range(args.repeat_apply):
                bank = SlotBank(root, max_loras=k, keymap=keymap, device=device,
                                dtype=root.get_dtype_inference(), model_name="Flux")
                firsts.append(timer.once(lambda: bank.activate(list(zip(adapters[:k], ones)))))
                bank.release()
            bank = SlotBank(root, max_loras=k, keymap=keymap, device=device, dtype=root.get_dtype_inference(),
                            model_name="Flux")
            r["base_ours"], r["step_ours"], r["ratio_ours"], r["cpuratio_ours"] = paired(
                bank.deactivate, lambda: bank.activate(list(zip(adapters[:k], ones))), args.repeat)
            r["strength_ours"] = timer.median(lambda: bank.set_strength(adapters[0], next(values)), 50)
            r["first_ours"] = statistics.median(firsts)
            r["mem_ours"] = bank.occupancy()["bytes"]
            swaps = itertools.cycle([list(zip(adapters[k:2 * k], ones)), list(zip(adapters[:k], ones))])
            r["swap_ours"] = timer.median(lambda: bank.activate(next(swaps)), 3)
            bank.release()
            # The same slider move through ComfyUI: MultiLoRALoader's clone + load_models_gpu.
            reset()

            def ours_clone(strength_last):
                stack = [entry_of(a, s, 0.0) for a, s in zip(adapters[:k], ones[:-1] + [strength_last])]
                return bridge.apply_stack(base, None, stack, k)[0]

            held = [ours_clone(1.0)]
            mm.load_models_gpu(held)

            def ours_change():
                m = ours_clone(next(values))
                mm.load_models_gpu([m])
                held[0] = m  # ComfyUI's cache holds the node's output until the next run replaces it

            r["strength_ours_comfy"] = timer.median(ours_change, args.repeat)
            del held
            mm.unload_all_models()
            shared = root.__dict__.get("_lora_engine_bank")
            if shared is not None:
                shared.release()

        if "fused" in paths:
            def fused_chain(strengths, start=None, first=0):
                m = start or base
                for sd, s in zip(lora_sds[first:], strengths):
                    m = comfy.sd.load_lora_for_models(m, None, sd, s, 0)[0]
                return m

            firsts = []
            for i in range(args.repeat_apply_fused):
                reset()
                held = []

                def fused_first():
                    held.append(fused_chain(ones))  # the graph's cache holds the last node's output
                    mm.load_models_gpu(held)

                firsts.append(timer.once(fused_first))
            patched = held[0]
            r["first_fused"] = statistics.median(firsts)
            swap = WeightSwap(comfy, root, patched.backup)
            r["base_fused"], r["step_fused"], r["ratio_fused"], r["cpuratio_fused"] = paired(
                swap.base, swap.patched, args.repeat)
            swap.patched()  # ComfyUI unpatches from here
            r["mem_fused"] = tensor_bytes(b.weight for b in patched.backup.values())
            prefix = fused_chain(ones[:-1])  # the upstream LoraLoader nodes' cached outputs
            keep = [patched]

            def fused_change():
                m = comfy.sd.load_lora_for_models(prefix, None, lora_sds[k - 1], next(values), 0)[0]
                mm.load_models_gpu([m])
                keep[0] = m  # ComfyUI's cache holds the node's output until the next run replaces it

            r["strength_fused"] = timer.median(fused_change, args.repeat, warmup=0)
            del keep, patched, prefix, swap
            reset()

        if "bypass" in paths:
            Injection = comfy.patcher_extension.PatcherInjection
            Manager = comfy.weight_adapter.BypassInjectionManager

            def bypass_one(sd, s):
                """One LoraLoaderBypass node's output (its own clone and injection)."""
                return comfy.sd.load_bypass_lora_for_models(base, None, sd, s, 0)[0].get_injections("bypass_lora")

            def bypass_model(parts):
                if k == 1:
                    injs = parts[0]
                else:
                    flat = [i for p in parts for i in p]
                    injs = [Injection(inject=lambda mp: [i.inject(mp) for i in flat],
                                      eject=lambda mp: [i.eject(mp) for i in reversed(flat)])]
                m = base.clone()
                m.set_injections("bypass_lora", injs)
                m.bypass_parts = parts
                return m

            def bypass_bytes(parts) -> int:
                seen, total = set(), 0
                for p in parts:
                    for inj in p:
                        for cell in inj.inject.__closure__ or ():
                            mgr = cell.cell_contents
                            if isinstance(mgr, Manager):
                                for h in mgr.hooks:
                                    for w in h.adapter.weights or ():
                                        if isinstance(w, torch.Tensor) and id(w) not in seen:
                                            seen.add(id(w))
                                            total += w.numel() * w.element_size()
                return total

            firsts = []
            for i in range(args.repeat_apply):
                reset()
                held = []

                def bypass_first():
                    held.append(bypass_model([bypass_one(sd, 1.0) for sd in lora_sds[:k]]))
                    mm.load_models_gpu(held)

                firsts.append(timer.once(bypass_first))
            loaded = held[0]
            r["first_bypass"] = statistics.median(firsts)
            r["base_bypass"], r["step_bypass"], r["ratio_bypass"], r["cpuratio_bypass"] = paired(
                loaded.eject_model, loaded.inject_model, args.repeat)
            r["mem_bypass"] = bypass_bytes(loaded.bypass_parts)
            upstream = loaded.bypass_parts[:-1]
            keep = [loaded]

            def bypass_change():
                m = bypass_model(upstream + [bypass_one(lora_sds[k - 1], next(values))])
                mm.load_models_gpu([m])
                keep[0] = m

            r["strength_bypass"] = timer.median(bypass_change, args.repeat, warmup=0)
            swaps = itertools.cycle([lora_sds[k:2 * k], lora_sds[:k]])

            def bypass_swap():
                m = bypass_model([bypass_one(sd, 1.0) for sd in next(swaps)])
                mm.load_models_gpu([m])
                keep[0] = m

            r["swap_bypass"] = timer.median(bypass_swap, 3)
            del keep, loaded, upstream
            reset()

        rows[k] = r
        print(f"  k={k}: " + ", ".join(f"{n} {v * 1e3:.1f} ms" if n[:4] not in ("mem_", "rati", "cpur") else
                                      f"{n} {v / 2**20:.0f} MB" if n.startswith("mem") else f"{n} {v:.3f}"
                                      for n, v in r.items()), f"({machine_line()})", flush=True)

    print_tables(rows, ks, paths)
    print(f"\nmachine after: {machine_line()}; whole run {time.monotonic() - t_start:.0f} s")
    return 0


def print_tables(rows, ks, paths) -> None:
    def ms(v):
        if v is None:
            return "-"
        return f"{v * 1e3:.3f}" if v < 0.01 else f"{v * 1e3:.1f}"

    def mb(v):
        return "-" if v is None else f"{v / 2**20:.0f}"

    groups = [("step ms", "step", ["ours", "fused", "bypass"], ms),
              ("strength change ms", "strength", ["ours", "ours_comfy", "fused", "bypass"], ms),
              ("first application ms", "first", ["ours", "fused", "bypass"], ms),
              ("LoRA swap ms", "swap", ["ours", "bypass"], ms),
              ("memory MB", "mem", ["ours", "fused", "bypass"], mb)]
    names = {"ours": "ours", "ours_comfy": "ours†", "fused": "fused", "bypass": "bypass"}
    w = 9
    top = f"{'':>2} | {'base':>{w}} |"
    sub = f"{'k':>2} | {'step ms':>{w}} |"
    for title, _, cols, _ in groups:
        width = len(cols) * (w + 1) - 1
        top += f" {title:^{width}} |"
        sub += " " + " ".join(f"{names[c]:>{w}}" for c in cols) + " |"
    print("\n" + top)
    print(sub)
    print("-" * len(sub))
    for k in ks:
        r = rows[k]
        base = statistics.median([r[b] for b in ("base_ours", "base_fused", "base_bypass") if b in r])
        line = f"{k:>2} | {ms(base):>{w}} |"
        for _, key, cols, fmt in groups:
            line += " " + " ".join(f"{fmt(r.get(f'{key}_{c}')):>{w}}" for c in cols) + " |"
        print(line)
    print("ours: bank.set_strength; ours†: the same move through ComfyUI (MultiLoRALoader clone + load_models_gpu).")
    print("memory: ours = slot buffers on the device; fused = weight backups (ModelPatcher.backup); "
          "bypass = adapter weights moved to the device.")

    def ratio(a, b):
        return "-" if a is None or b is None or b == 0 else (f"{a / b:.2g}x" if a / b < 0.1 else f"{a / b:.2f}x")

    print("\nratios, ours / ComfyUI (below 1: ours is cheaper)")
    hdr = (f"{'k':>2} | {'step / base step, wall':>22} | {'step / base, cpu':>22} | {'step':>15} | "
           f"{'strength (set_strength)':>23} | {'strength† (via ComfyUI)':>23} | {'first application':>17} | "
           f"{'swap':>7} | {'memory':>15}")
    print(hdr)
    sub = (f"{'':>2} | {'ours':>6} {'fused':>7} {'bypass':>7} | {'ours':>6} {'fused':>7} {'bypass':>7} | "
           f"{'/fused':>7} {'/bypass':>7} | {'/fused':>11} "
           f"{'/bypass':>11} | {'/fused':>11} {'/bypass':>11} | {'/fused':>8} {'/bypass':>8} | {'/bypass':>7} | "
           f"{'/fused':>7} {'/bypass':>7}")
    print(sub)
    print("-" * len(hdr))
    for k in ks:
        r = rows[k]
        g = r.get

        def vs_base(p, kind="ratio"):
            v = g(f"{kind}_{p}")
            return "-" if v is None else f"{v:.3f}"

        print(f"{k:>2} | {vs_base('ours'):>6} {vs_base('fused'):>7} {vs_base('bypass'):>7} | "
              f"{vs_base('ours', 'cpuratio'):>6} {vs_base('fused', 'cpuratio'):>7} "
              f"{vs_base('bypass', 'cpuratio'):>7} | "
              f"{ratio(g('ratio_ours'), g('ratio_fused')):>7} {ratio(g('ratio_ours'), g('ratio_bypass')):>7} | "
              f"{ratio(g('strength_ours'), g('strength_fused')):>11} "
              f"{ratio(g('strength_ours'), g('strength_bypass')):>11} | "
              f"{ratio(g('strength_ours_comfy'), g('strength_fused')):>11} "
              f"{ratio(g('strength_ours_comfy'), g('strength_bypass')):>11} | "
              f"{ratio(g('first_ours'), g('first_fused')):>8} {ratio(g('first_ours'), g('first_bypass')):>8} | "
              f"{ratio(g('swap_ours'), g('swap_bypass')):>7} | "
              f"{ratio(g('mem_ours'), g('mem_fused')):>7} {ratio(g('mem_ours'), g('mem_bypass')):>7}")

    print("step: each path's step / base ratio over ours (each paired with its own base steps)")
    print("\nafter a slider move: steps until the fused path's re-patch is paid back by its cheaper steps, "
          "(fused re-patch - ours†) / ((our step / base - fused step / base) x our base step)")
    for k in ks:
        r = rows[k]
        if not all(n in r for n in ("ratio_ours", "ratio_fused", "strength_fused", "strength_ours_comfy")):
            continue
        extra = (r["ratio_ours"] - r["ratio_fused"]) * r["base_ours"]
        saved = r["strength_fused"] - r["strength_ours_comfy"]
        print(f"{k:>2} | " + (f"{saved / extra:.0f} steps" if extra > 0 else "never: our step was not slower"))


if __name__ == "__main__":
    sys.exit(main())
