"""Engine benchmark on blocks shaped like a Flux-sized DiT, measured side by side in one run.

Each block has Flux-dev's Linear shapes (hidden 3072, fused qkv 9216, MLP 12288; --hidden scales them).
The token count is short so that it runs on a CPU. It prints, for k = 1, 2, 4, 8
adapters at rank 32:

- step time against the base step (the runtime overhead), with all k adapters live;
- the same for bare GEMMs: plain forward hooks that add x·Aᵀ·Bᵀ from the same slot
  buffers and do nothing else. That is the arithmetic any runtime method has to do,
  so "ours / bare" is what the engine's own bookkeeping costs;
- the step time with one adapter live and the other k − 1 warm at strength 0 (their
  slots are cut from the GEMMs, so this should match k = 1);
- the cost of a strength change, against re-fusing the weights (restore each
  weight from its backup, then add s·ΔW of every adapter in fp32, as a fusing
  loader does after a slider move);
- break-even: how many steps after a slider move a fusing loader needs to catch up,
  (re-fuse − strength change) / (our step − base step);
- the activation cost for adapters already in the warm cache;
- a stack grown by one entry: the (k+1)-th adapter into a bank of k slots, grown in
  place (the k resident adapters' rows copied on the device), against a new bank of
  k+1 slots that copies every adapter from the host (--grow k; 0 skips it);
- per-item strengths on a batch (--grid items), against one shared strength per adapter, and
  what setting a conditioning's strengths costs per model call (`SlotBank.set_items`);
- a LyCORIS LoHa and LoKr (--lycoris rank), which run as the exact low-rank forms of their
  products, against the same ΔW as a full diff on the dense path: step, activation, slot bytes.

Step times are paired: each round runs base, ours, bare and one-live once, in turn, and
each ratio is the median of the per-round ratios, so load from other jobs moves both
sides of a ratio.

    python bench/engine_bench.py                   # CPU defaults
    python bench/engine_bench.py --device cuda --blocks 19 --tokens 4096 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lora_engine import AdapterCache, SlotBank  # noqa: E402  (after the sys.path line)
from lora_engine.adapter import _pack, _pow2  # noqa: E402
from lora_engine.layer import Rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_line  # noqa: E402

HIDDEN = 3072  # Flux-dev; the MLP is 4 × hidden


class Block(nn.Module):
    def __init__(self, hidden: int, mlp: int):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp_in = nn.Linear(hidden, mlp)
        self.mlp_out = nn.Linear(mlp, hidden)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.proj(torch.tanh(q) * v + k)
        return x + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(x)))


class Model(nn.Module):
    def __init__(self, blocks: int, hidden: int, mlp: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, mlp) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def write_adapter(model: nn.Module, path: str, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            p = "lora_unet_" + name.replace(".", "_")
            t[p + ".lora_down.weight"] = (torch.randn(rank, m.in_features, generator=g) * 0.01).to(torch.bfloat16)
            t[p + ".lora_up.weight"] = (torch.randn(m.out_features, rank, generator=g) * 0.01).to(torch.bfloat16)
            t[p + ".alpha"] = torch.tensor(float(rank))
    save_file(t, path)


def write_lycoris(model: nn.Module, path: str, kind: str, rank: int, seed: int) -> None:
    """On every Linear: a LoHa (two rank-`rank` pairs), a LoKr (w1 [f, f] full, f = 16 or less, and w2 of rank
    `rank`, LyCORIS's usual split), or a full LoKr (`lokr-full`: w2 full too, no alpha, as LyCORIS writes a LoKr of
    full dimension, SimpleTuner's usual LoKr)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            p, o, i = "lora_unet_" + name.replace(".", "_"), m.out_features, m.in_features
            if kind == "loha":
                for j in (1, 2):
                    t[f"{p}.hada_w{j}_a"], t[f"{p}.hada_w{j}_b"] = rand(o, rank), rand(rank, i)
                t[p + ".alpha"] = torch.tensor(float(rank))
                continue
            f = next(f for f in (16, 8, 4, 2, 1) if o % f == 0 and i % f == 0)
            t[f"{p}.lokr_w1"] = rand(f, f)
            if kind == "lokr-full":
                t[f"{p}.lokr_w2"] = rand(o // f, i // f)
            else:
                t[f"{p}.lokr_w2_a"], t[f"{p}.lokr_w2_b"] = rand(o // f, rank), rand(rank, i // f)
                t[p + ".alpha"] = torch.tensor(float(rank))
    save_file(t, path)


def as_diff(model: nn.Module, adapter, path: str) -> None:
    """The adapter's ΔW on each Linear, as a file of full diffs: the same delta on the dense path."""
    t = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            p = "lora_unet_" + name.replace(".", "_")
            t[p + ".diff"] = adapter.layers[p].weight.delta(m.weight.shape).to(torch.bfloat16).contiguous()
    save_file(t, path)


def lycoris_line(model, x, tmp: str, rank: int, device, dtype, repeat: int) -> str:
    """LoHa and LoKr at `rank`, run as the low-rank forms of their products, and a full LoKr, applied as its two
    factors, against the same ΔW as full diffs on the dense path: paired steps (one bank holds both, one at
    strength 1 and the other at 0, which is cut from the step), activation into a fresh bank (median of 3) and the
    slots' bytes."""
    lines = []
    for kind in ("loha", "lokr", "lokr-full"):
        cache = AdapterCache(max_items=2, max_bytes=1 << 40)
        path = os.path.join(tmp, f"{kind}.safetensors")
        write_lycoris(model, path, kind, rank, seed=200)
        product = cache.load(path)
        as_diff(model, product, os.path.join(tmp, f"{kind}_diff.safetensors"))
        dense = cache.load(os.path.join(tmp, f"{kind}_diff.safetensors"))
        probe = SlotBank(model, max_loras=1)
        binding = probe.binding(product)
        report, ranks = binding.report, sorted({p.rank for p in binding.plans.values() if p.low_rank})
        probe.release()
        held, first = {}, {}
        for name, adapter in (("product", product), ("dense", dense)):
            times = []
            for _ in range(3):
                bank = SlotBank(model, max_loras=1, dtype=dtype, device=device)
                t0 = time.perf_counter()
                bank.activate([(adapter, 1.0)])
                sync(device)
                times.append(time.perf_counter() - t0)
                held[name] = bank.occupancy()["bytes"]
                bank.release()
            first[name] = statistics.median(times)
        bank = SlotBank(model, max_loras=2, dtype=dtype, device=device)
        bank.activate([(product, 1.0), (dense, 0.0)])
        variants = {"base": bank.deactivate, "product": lambda: bank.activate([(product, 1.0), (dense, 0.0)]),
                    "dense": lambda: bank.activate([(product, 0.0), (dense, 1.0)])}
        with torch.inference_mode():
            steps = paired(variants, lambda: model(x), device, repeat, before=lambda: None)
            bank.activate([(product, 1.0), (dense, 0.0)])
            a = model(x).float()
            bank.activate([(product, 0.0), (dense, 1.0)])
            b = model(x).float()
        bank.release()
        step = {n: f"{steps[n]['ratio']:.3f} / {steps[n]['cpu_ratio']:.3f}" for n in ("product", "dense")}
        ms = {n: f"{first[n] * 1e3:.0f} ms" for n in first}
        mb = {n: f"{held[n] / 2**20:.1f} MB" for n in held}
        how = f"product rank {','.join(map(str, ranks))}, " if ranks else ""
        lines.append(f"{kind} (rank {rank}; {how}{report.low_rank} low-rank, {report.kron} kronecker, "
                     f"{report.dense} dense layers): "
                     f"step {step['product']} x base, as a diff {step['dense']}; "
                     f"activation {ms['product']}, as a diff {ms['dense']}; slots {mb['product']}, as a diff "
                     f"{mb['dense']}; outputs differ by {(a - b).abs().max().item():.2e} of "
                     f"{a.abs().max().item():.2f} (the diff stored in bf16)")
    return "\nLyCORIS products (wall / CPU step ratios):\n" + "\n".join(lines)


def refuse(linears: dict[str, nn.Linear], backups: dict[str, torch.Tensor], adapters, strength: float) -> None:
    """What a fusing loader does after a slider move: restore each weight from its backup, then add
    s·ΔW of every adapter, computed in fp32."""
    for name, m in linears.items():
        w = backups[name].float()
        for a in adapters:
            lp = a.layers["lora_unet_" + name.replace(".", "_")]
            w += strength * lp.weight.delta(w.shape, w.device)
        m.weight.copy_(w.to(m.weight.dtype))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class BareGemms:
    """Forward hooks that add x·Aᵀ·Bᵀ from a bank's slot buffers and nothing else."""

    def __init__(self, model: nn.Module, bank: SlotBank):
        modules = dict(model.named_modules())
        self.parts = [(modules[name], layer.a, layer.b) for name, layer in bank.layers.items()]
        self.handles = []

    def attach(self) -> None:
        for module, a, b in self.parts:
            def hook(_module, args, out, a=a, b=b):
                out.view(-1, out.shape[-1]).addmm_(F.linear(args[0], a).view(-1, a.shape[0]), b.t())
            self.handles.append(module.register_forward_hook(hook))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def paired(variants: dict, step, device, rounds: int, before) -> dict:
    """Each round runs every variant once, in a rotating order (`before` resets between variants);
    per variant: its wall times, the median step in ms, and the medians over rounds of its ratio to the
    round's base in wall time and in this process's CPU time (which other jobs' load moves less)."""
    names = list(variants)
    for name in names:  # warm-up
        before()
        variants[name]()
        step()
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before()
            variants[name]()
            sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    def ratio(series, n):
        return statistics.median(t / b for t, b in zip(series[n], series["base"]))

    before()
    return {n: {"ms": statistics.median(times[n]) * 1e3, "times": times[n], "ratio": ratio(times, n),
                "cpu_ratio": ratio(cpu, n)} for n in names}


def copy_floor(adapters, device, repeat: int = 5) -> float:
    """Seconds to copy the adapters' stored bytes once (from pinned memory to the device on a GPU, memory to
    memory on a CPU): what activating them can at best approach."""
    tensors = [t for a in adapters for lp in a.layers.values() for t in lp.tensors()]
    n = sum(t.numel() for t in tensors)
    src = torch.empty(n, dtype=tensors[0].dtype)
    if device.type == "cuda":
        src = src.pin_memory()
    dst = torch.empty(n, dtype=src.dtype, device=device)
    return timed(lambda: dst.copy_(src, non_blocking=True), device, repeat)


def row(model, x, chosen, others, linears, backups, device, dtype, repeat: int) -> str:
    """One line of the table, for the k adapters in `chosen` (`others`: k more, swapped in and out)."""
    k = len(chosen)
    all_live = [(a, 1.0) for a in chosen]
    one_live = [(a, 1.0 if i == 0 else 0.0) for i, a in enumerate(chosen)]

    def activate():
        fresh = SlotBank(model, max_loras=k, dtype=dtype, device=device)
        fresh.activate(all_live)
        return fresh

    activations = []
    for _ in range(3):
        t0 = time.perf_counter()
        bank = activate()
        sync(device)
        activations.append(time.perf_counter() - t0)
        bank.release()
    bank = activate()
    sets = iter([[(a, 1.0) for a in others], all_live] * 100)
    swap = timed(lambda: bank.activate(next(sets)), device, 4)  # k newcomers into warm slots, every time
    bank.activate(all_live)
    bare = BareGemms(model, bank)
    variants = {"base": bank.deactivate, "ours": lambda: bank.activate(all_live),
                "bare": lambda: (bank.deactivate(), bare.attach()), "one": lambda: bank.activate(one_live)}
    with torch.inference_mode():
        steps = paired(variants, lambda: model(x), device, repeat, before=bare.detach)
    values = iter([0.5, 0.75] * 10000)
    bank.activate(all_live)
    change = timed(lambda: bank.set_strength(chosen[0], next(values)), device, 50)
    bank.release()
    with torch.no_grad():
        refuse_t = timed(lambda: refuse(linears, backups, chosen, next(values)), device, 1)
        for n, m in linears.items():
            m.weight.copy_(backups[n])
    extra_ms = (steps["ours"]["ratio"] - 1) * steps["base"]["ms"]
    even = f"{(refuse_t - change) * 1e3 / extra_ms:.0f} steps" if extra_ms > 0 else "never"
    def both(name, width):
        return f"{steps[name]['ratio']:.3f} / {steps[name]['cpu_ratio']:.3f}".rjust(width)

    return (f"{k:>2} | {steps['base']['ms']:7.1f} | {steps['ours']['ms']:7.1f} | {both('ours', 13)} | "
            f"{both('bare', 13)} | {both('one', 17)} | {change * 1e3:12.3f} ms | "
            f"{refuse_t:6.2f} s | {even:>10} | {statistics.median(activations) * 1e3:9.1f} ms | "
            f"{swap * 1e3:8.1f} ms | {copy_floor(chosen, device) * 1e3:8.1f} ms")


def per_item_line(model, chosen, items: int, tokens: int, device, dtype, repeat: int) -> str:
    """A strength grid as one batch: every item with its own strengths, against the same batch with one
    shared strength per adapter (the same adapters, the same GEMMs)."""
    x = torch.randn(items, tokens, model.blocks[0].proj.in_features, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    per_item = [(a, torch.rand(items, generator=g).tolist()) for a in chosen]
    shared = [(a, 0.5) for a in chosen]
    bank = SlotBank(model, max_loras=len(chosen), dtype=dtype, device=device)
    variants = {"base": bank.deactivate, "shared": lambda: bank.activate(shared),
                "per_item": lambda: bank.activate(per_item)}
    with torch.inference_mode():
        steps = paired(variants, lambda: model(x), device, repeat, before=lambda: None)
    # A conditioning's strengths (LoRAConditioningStrengths) are set per model call: here two tables alternate whose
    # zero patterns differ, as a sampler's regions and its negative would.
    bank.activate(shared)
    tables = [{a: [float(i % 2 == j) for i in range(items)] for a in chosen} for j in (0, 1)]
    turn = iter(range(1 << 30))
    per_call = timed(lambda: bank.set_items(tables[next(turn) % 2]), device, 20 * repeat)
    layers = len(bank.layers)
    bank.release()
    ratio = statistics.median(p / s for p, s in zip(steps["per_item"]["times"], steps["shared"]["times"]))
    return (f"\nper-item strengths, k={len(chosen)}, batch {items} x {tokens} tokens: shared {steps['shared']['ms']:.1f} ms "
            f"({steps['shared']['ratio']:.3f}x base), per item {steps['per_item']['ms']:.1f} ms "
            f"({steps['per_item']['ratio']:.3f}x base); per item / shared {ratio:.3f}x wall\n"
            f"conditioning strengths: set per model call in {per_call * 1e3:.3f} ms ({layers} layers; two tables "
            "of different zero patterns in turn)")


def mixed_line(model, x, tmp: str, ranks: list[int], device, dtype, repeat: int) -> str:
    """Adapters of different ranks: each layer computes only the filled rows of its slots (packed), against
    the same slots computed with their padding (packing switched off)."""
    cache = AdapterCache(max_items=len(ranks))
    chosen = []
    for i, r in enumerate(ranks):
        path = os.path.join(tmp, f"mixed{i}.safetensors")
        write_adapter(model, path, r, seed=100 + i)
        chosen.append(cache.load(path))
    entries = [(a, 1.0) for a in chosen]
    bank = SlotBank(model, max_loras=len(chosen), dtype=dtype, device=device)

    def with_saving(saving: float):
        def activate():
            Rows.SAVING = saving
            bank.deactivate()
            bank.release()
            bank.activate(entries)
        return activate

    default = Rows.SAVING
    try:
        with torch.inference_mode():
            steps = paired({"base": bank.deactivate, "packed": with_saving(default), "padded": with_saving(0.0)},
                           lambda: model(x), device, repeat, before=lambda: None)
    finally:
        Rows.SAVING = default
        bank.release()
    return (f"\nranks {','.join(map(str, ranks))}: packed {steps['packed']['ratio']:.3f} / "
            f"{steps['packed']['cpu_ratio']:.3f} x base, padded {steps['padded']['ratio']:.3f} / "
            f"{steps['padded']['cpu_ratio']:.3f} x base (wall / CPU)")


def grow_line(model, adapters, k: int, device, dtype, rounds: int = 3) -> str:
    """The (k+1)-th adapter of a stack into a bank of k slots: the bank grown in place against a new bank of
    k+1 slots, alternating, medians of `rounds`."""
    stack = [(a, 1.0) for a in adapters[:k + 1]]
    times = {"grown": [], "new": []}
    for _ in range(rounds):
        bank = SlotBank(model, max_loras=k, dtype=dtype, device=device)
        bank.activate(stack[:k])
        sync(device)
        t0 = time.perf_counter()
        bank.grow(k + 1)
        bank.activate(stack)
        sync(device)
        times["grown"].append(time.perf_counter() - t0)
        bank.release()
        t0 = time.perf_counter()
        bank = SlotBank(model, max_loras=k + 1, dtype=dtype, device=device)
        bank.activate(stack)
        sync(device)
        times["new"].append(time.perf_counter() - t0)
        bank.release()
    grown, new = (statistics.median(times[n]) * 1e3 for n in ("grown", "new"))
    return (f"\nstack grown from {k} to {k + 1} adapters: bank grown in place {grown:.1f} ms (1 adapter copied), "
            f"a new bank {new:.1f} ms ({k + 1} copied): {grown / new:.2f}x")


FLUX_DEV_LINEARS = (  # (out, in) of each block Linear of Flux-dev: 19 double blocks (image and text side), 38 single
    [(9216, 3072), (3072, 3072), (12288, 3072), (3072, 12288), (18432, 3072)] * 2 * 19
    + [(21504, 3072), (3072, 15360), (9216, 3072)] * 38)


def pinned_lines(adapter, rank: int) -> str:
    """Host bytes an adapter takes pinned: packed into buffers as loading does on a CUDA machine, against one pinned
    buffer per tensor. Both follow PyTorch's pinned allocator, which rounds each request up to a power of two;
    counted from the requested sizes (meta tensors), so these lines need no GPU. For this run's adapter, and for
    a Flux-dev LoRA of the same rank on every block Linear."""
    flux = [torch.empty(*s, dtype=torch.bfloat16, device="meta")
            for o, i in FLUX_DEV_LINEARS for s in ((rank, i), (o, rank))]
    ours = [t.to("meta") for lp in adapter.layers.values() for t in lp.tensors()]
    lines = []
    for label, tensors in (("this run's adapter", ours), (f"a Flux-dev rank-{rank} LoRA (bf16)", flux)):
        sizes = []

        def allocate(n):
            sizes.append(n)
            return torch.empty(n, dtype=torch.uint8, device="meta")

        _pack(tensors, allocate)
        raw = sum(t.numel() * t.element_size() for t in tensors)
        per_tensor = sum(_pow2(t.numel() * t.element_size()) for t in tensors)
        lines.append(f"pinned host memory, {label}: {raw / 2**20:.1f} MB in {len(tensors)} tensors; packed "
                     f"{sum(sizes) / 2**20:.1f} MB in {len(sizes)} buffers ({sum(sizes) / raw:.3f}x), one buffer "
                     f"per tensor {per_tensor / 2**20:.1f} MB ({per_tensor / raw:.3f}x)")
    return "\n" + "\n".join(lines)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_args(doc: str) -> argparse.ArgumentParser:
    """The options that choose the model and the adapters, shared with compile_bench.py."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size (default 3072, Flux-dev's); a small one "
                    "with many --blocks shows the per-layer costs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    return ap


def main() -> None:
    ap = model_args(__doc__)
    ap.add_argument("--repeat", type=int, default=9, help="paired rounds per k")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--grid", type=int, default=16, help="batch items for the per-item strength line (0: skip)")
    ap.add_argument("--grid-tokens", type=int, default=16, help="tokens per item in that batch")
    ap.add_argument("--mixed", default="16,16,32,128", help="ranks of the mixed-rank line (empty: skip)")
    ap.add_argument("--lycoris", type=int, default=8, help="rank of the LoHa and LoKr lines (0: skip them)")
    ap.add_argument("--grow", type=int, default=4, help="k of the line for a stack grown from k to k+1 adapters "
                    "(0: skip; at most 2 * max(ks) - 1)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    ks = [int(k) for k in args.ks.split(",")]
    torch.manual_seed(0)

    model = Model(args.blocks, args.hidden, 4 * args.hidden).to(device, dtype).eval()
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype)
    n_layers = sum(isinstance(m, nn.Linear) for m in model.modules())
    print(f"model: {args.blocks} Flux-shaped blocks at hidden {args.hidden} ({n_layers} Linear layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params), {args.tokens} tokens, "
          f"{args.dtype} on {device}; adapters at rank {args.rank}; torch {torch.__version__}")
    print(f"machine before: {machine_line()}")

    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    paths = []
    for i in range(2 * max(ks)):
        p = os.path.join(tmp, f"adapter{i}.safetensors")
        write_adapter(model, p, args.rank, seed=i)
        paths.append(p)
    cache = AdapterCache(max_items=len(paths))
    adapters = [cache.load(p) for p in paths]  # the cache is warm from here on

    header = (f"{'k':>2} | {'base ms':>7} | {'ours ms':>7} | {'ours / base':>13} | {'bare / base':>13} | "
              f"{'1 live + k-1 at 0':>17} | {'strength change':>15} | {'re-fuse':>8} | {'break-even':>10} | "
              f"{'activate: fresh bank':>20} | {'swap k':>11} | {'copy floor':>11}")
    print("\nstep ratios are wall / CPU time, medians of per-round ratios; activation from the warm cache into a "
          "fresh bank, and k other adapters swapped into warm slots, against one copy of the adapters' stored "
          "bytes\n" + header)
    print("-" * len(header))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    backups = {n: m.weight.detach().clone() for n, m in linears.items()}  # what a fusing loader keeps
    for k in ks:
        print(row(model, x, adapters[:k], adapters[k:2 * k], linears, backups, device, dtype, args.repeat), flush=True)
    if args.mixed:
        print(mixed_line(model, x, tmp, [int(r) for r in args.mixed.split(",")], device, dtype, args.repeat))
    if 0 < args.grow < len(adapters):
        print(grow_line(model, adapters, args.grow, device, dtype))
    if args.lycoris:
        print(lycoris_line(model, x, tmp, args.lycoris, device, dtype, args.repeat), flush=True)
    if args.grid:
        print(per_item_line(model, adapters[:min(4, len(adapters))], args.grid, args.grid_tokens, device, dtype,
                            args.repeat))
    print(pinned_lines(adapters[0], args.rank))
    print(f"\ncache: {cache.stats()}")
    print(f"machine after: {machine_line()}")


if __name__ == "__main__":
    main()
