"""The engine under torch.compile (inductor): recompiles counted across adapter changes, and the compiled step.

On engine_bench's Flux-shaped blocks, one compiled model runs through the changes a ComfyUI session makes:
slider moves (through 0 too), another adapter of the same rank swapped into a warm slot, an adapter
released and a newcomer into its slot, a schedule with its progress updates, a LoHa (a dense-path adapter)
written, then swapped for another LoHa in another slot, and per-item strengths.
After each change it checks the compiled output against eager and prints how many graphs inductor has
compiled so far. Then it times, paired round by round, the compiled step with k adapters against the
compiled base step, and the same in eager mode.

    python bench/compile_bench.py                                  # CPU (inductor needs a C++ compiler)
    python bench/compile_bench.py --device cuda --dtype bf16 --tokens 4096
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_bench import DTYPES, Model, model_args, paired, sync, write_adapter  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from lora_engine import AdapterCache, Entry, Schedule, SlotBank  # noqa: E402


def write_loha(model: torch.nn.Module, path: str, rank: int, seed: int) -> None:
    """A LyCORIS LoHa on every Linear. At rank 64 its product has rank 4096, more than ΔW holds on these layers: a
    dense-path adapter, whose ΔW each layer holds in full."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    t = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            p = "lora_unet_" + name.replace(".", "_")
            for i in (1, 2):
                t[f"{p}.hada_w{i}_a"] = (torch.randn(m.out_features, rank, generator=g) * 0.1).to(torch.bfloat16)
                t[f"{p}.hada_w{i}_b"] = (torch.randn(rank, m.in_features, generator=g) * 0.1).to(torch.bfloat16)
            t[p + ".alpha"] = torch.tensor(float(rank))
    save_file(t, path)


def main() -> int:
    ap = model_args(__doc__)
    ap.add_argument("--k", type=int, default=4, help="adapters held (one more is written, for the swap)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    try:
        from torch._dynamo.testing import CompileCounterWithBackend
    except ImportError:
        sys.exit("this torch build has no dynamo")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.manual_seed(0)
    model = Model(args.blocks, args.hidden, 4 * args.hidden).to(device, dtype).eval()
    x = torch.randn(2, args.tokens, args.hidden, device=device, dtype=dtype)  # 2 items, for per-item strengths
    print(f"model: {args.blocks} Flux-shaped blocks, batch 2 x {args.tokens} tokens, {args.dtype} on {device}; k = {args.k} "
          f"adapters at rank {args.rank}; torch {torch.__version__}")
    print(f"machine before: {machine_line()}")

    tmp = tempfile.mkdtemp(prefix="lora-compile-")
    cache = AdapterCache(max_items=args.k + 3)
    adapters = []
    for i in range(args.k + 1):
        path = os.path.join(tmp, f"adapter{i}.safetensors")
        write_adapter(model, path, args.rank, seed=i)
        adapters.append(cache.load(path))
    held, spare = adapters[:args.k], adapters[args.k]
    lohas = []
    for i in range(2):
        path = os.path.join(tmp, f"loha{i}.safetensors")
        write_loha(model, path, 64, seed=100 + i)
        lohas.append(cache.load(path))
    bank = SlotBank(model, max_loras=args.k, dtype=dtype, device=device)
    bank.activate([(a, 1.0) for a in held])

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    first, second = held[0], held[-1]
    items = [1.0, 0.5]
    changes = [
        ("first run (compiles)", lambda: None),
        ("slider move", lambda: bank.set_strength(first, 0.4)),
        ("the last slot to 0", lambda: bank.set_strength(second, 0.0)),
        ("every strength 0", lambda: bank.activate([(a, 0.0) for a in held])),
        ("back to 1", lambda: bank.activate([(a, 1.0) for a in held])),
        ("another adapter of the same rank swapped in", lambda: bank.activate([(a, 1.0) for a in held[:-1]]
                                                                              + [(spare, 0.7)])),
        ("an adapter released", lambda: bank.activate([(a, 1.0) for a in held[:-1]])),
        ("a newcomer into the free slot", lambda: bank.activate([(a, 1.0) for a in held])),
        ("a schedule", lambda: bank.activate([Entry(first, 1.0, Schedule.parse("0:1, 1:0"))]
                                             + [(a, 1.0) for a in held[1:]])),
        ("schedule progress 0.5", lambda: bank.set_progress(0.5)),
        ("schedule progress 1", lambda: bank.set_progress(1.0)),
        ("a LoHa in the last slot (first dense deltas: one recompile expected)",
         lambda: bank.activate([(a, 1.0) for a in held[:-1]] + [(lohas[0], 0.8)])),
        ("another LoHa, into the first slot (the first LoHa released)",
         lambda: bank.activate([(lohas[1], 0.8)] + [(a, 1.0) for a in held[1:]])),
        ("the LoHa to 0, then back", lambda: (bank.set_strength(lohas[1], 0.0), bank.set_strength(lohas[1], 0.6))),
        ("per-item strengths (the scale's shape changes: one recompile expected)",
         lambda: bank.activate([(a, items) for a in held])),
        ("per-item slider move", lambda: bank.set_strength(first, [0.5] * len(items))),
    ]
    print(f"\n{'change':<72} | graphs compiled | max |compiled - eager|")
    print("-" * 112)
    with torch.inference_mode():
        for name, change in changes:
            change()
            t0 = time.perf_counter()
            got = compiled(x)
            sync(device)
            took = time.perf_counter() - t0
            want = model(x)
            err = (got.float() - want.float()).abs().max().item()
            flag = "" if err <= tol * want.float().abs().max().item() else "  MISMATCH"
            print(f"{name:<72} | {counter.frame_count:>15} | {err:.2e}{flag} ({took:.2f} s)", flush=True)

    bank.activate([(a, 1.0) for a in held])
    with torch.inference_mode():
        compiled(x)  # back to one shared strength per adapter: the graph for that shape exists already
        steps = paired({"base": bank.deactivate, "ours": lambda: bank.activate([(a, 1.0) for a in held])},
                       lambda: compiled(x), device, args.repeat, before=lambda: None)
        eager = paired({"base": bank.deactivate, "ours": lambda: bank.activate([(a, 1.0) for a in held])},
                       lambda: model(x), device, args.repeat, before=lambda: None)
    print(f"\ngraphs compiled in all: {counter.frame_count} (the base graph without adapters included)")
    print(f"compiled: base {steps['base']['ms']:.1f} ms, ours {steps['ours']['ms']:.1f} ms, "
          f"ours / base {steps['ours']['ratio']:.3f}x")
    print(f"eager:    base {eager['base']['ms']:.1f} ms, ours {eager['ours']['ms']:.1f} ms, "
          f"ours / base {eager['ours']['ratio']:.3f}x")
    print(f"machine after: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
