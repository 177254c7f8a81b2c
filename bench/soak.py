"""Soak: many prompts with random LoRA stacks against a real ComfyUI server, memory and state sampled
after every prompt.

    python bench/soak.py --prompts 200 --loras 30            # ~1-2 s a prompt on a CPU
    python bench/soak.py --prompts 40 --loras 10 --budget-mb 24 --max-minutes 20

It generates `--loras` synthetic LoRA files for the synthetic SD1.5 checkpoint (tools/synth.py: kohya,
PEFT and LoCon layouts, ranks 2/4/8, every fifth one without text-encoder layers), starts ComfyUI with
the pack on 127.0.0.1 with the engine's cache budget set through MULTILORA_CACHE_MAX_BYTES /
MULTILORA_CACHE_MAX_ITEMS (by default a quarter of the files' total, so the cache must evict), and
queues `--prompts` prompts: each a random stack of 1 to 4 of those files with random strengths,
sampled at 64x64 in 1 or 2 steps. After every prompt it reads the server's resident size
(/proc/<pid>/status) and GET /multilora/status, and checks:

- the cache: bytes equals the sum of its entries' bytes, and stays within its budget;
- the slot banks: at most one per model part (diffusion model, text encoder), every slot list as long
  as max_loras, at most max_loras occupied;
- the hooks: the engine's forward hooks counted on the modules equal the layers the banks hold;
- ComfyUI's loaded models: no weight patch and no weight backup.

After every prompt the resident size must stay within the first prompt's resident size + the cache
budget + the growth of the slot buffers since the first prompt (the banks' `bytes` in the status: they
grow to the largest stack and rank seen, by design) + `--rss-slack-mb` (default 256 MiB: ComfyUI's
history, allocator slack, and the adapters the slot banks keep alive through their bindings after the
cache evicted them). The curve goes to .artifacts/soak.csv as it is measured, the
summary to .artifacts/soak.json, and the exit status is 1 when a check failed, or when `--max-minutes`
ran out before the last prompt.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import comfy  # noqa: E402
from tools import comfy_server as cs  # noqa: E402
from tools import synth  # noqa: E402

ARTIFACTS = REPO / ".artifacts"
KINDS = ("kohya", "peft", "locon")
RANKS = (2, 4, 8)
MIB = 1024**2


# -- the LoRA files ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoraFile:
    name: str  # in the loras folder
    path: str  # the generated file (cached by its parameters)
    kind: str
    rank: int
    seed: int
    clip: bool
    size: int


def lora_specs(count: int, seed0: int = 5000, prefix: str = "soak") -> list[dict]:
    specs = []
    for i in range(count):
        kind, rank, clip = KINDS[i % 3], RANKS[(i // 3) % 3], i % 5 != 4
        targets = synth.STANDARD_LORAS["locon"]["targets"] if kind == "locon" else None
        specs.append(dict(kind=kind, seed=seed0 + i, rank=rank, targets=targets, include_clip=clip,
                          name=f"{prefix}_{i:02d}_{kind}_r{rank}{'' if clip else '_unet'}.safetensors"))
    return specs


_GENERATE = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from tools import synth
specs = json.loads(sys.argv[2])
out = []
for s in specs:
    kw = {k: v for k, v in s.items() if k != "name"}
    out.append(str(synth.cached_lora(**kw)))
print(json.dumps(out))
'''


def make_loras(count: int, comfy_root: Path, python: str, *, seed0: int = 5000, prefix: str = "soak") -> list[LoraFile]:
    """Generate (or reuse from the synth cache) `count` LoRA variants, named `<prefix>_<i>_<kind>_r<rank>`."""
    specs = lora_specs(count, seed0, prefix)
    try:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401
        manifest = synth.shape_manifest(comfy_root=comfy_root, python=python)
        paths = [str(synth.cached_lora(manifest=manifest, **{k: v for k, v in s.items() if k != "name"}))
                 for s in specs]
    except ImportError:  # this python has no torch: generate with ComfyUI's
        env = {**os.environ, "COMFYUI_PATH": str(comfy_root)}
        res = subprocess.run([python, "-c", _GENERATE, str(REPO), json.dumps(specs)], capture_output=True,
                             text=True, timeout=1800, env=env, stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise RuntimeError(f"generating the LoRA files failed:\n{res.stderr[-4000:]}")
        paths = json.loads(res.stdout.strip().splitlines()[-1])
    return [LoraFile(s["name"], p, s["kind"], s["rank"], s["seed"], s["include_clip"], os.path.getsize(p))
            for s, p in zip(specs, paths)]


def models_dir(root: Path, checkpoint: str, loras: list[LoraFile]) -> Path:
    """A models/ tree: the checkpoint linked, the LoRA files hard-linked (the pack refuses symlinks that
    leave the loras folder), or copied across file systems."""
    import shutil
    for sub in cs.MODEL_SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    ckpt = root / "checkpoints" / synth.CHECKPOINT_NAME
    if not ckpt.exists():
        ckpt.symlink_to(checkpoint)
    for lo in loras:
        dst = root / "loras" / lo.name
        if dst.exists():
            continue
        try:
            os.link(lo.path, dst)
        except OSError:
            shutil.copyfile(lo.path, dst)
    return root


# -- one prompt ---------------------------------------------------------------------------------------

def prompt(stack: list[dict], *, seed: int, steps: int, size: int = 64, prefix: str = "soak") -> dict:
    """Checkpoint -> LoRAStackFromJSON -> MultiLoRALoader -> text encode, sample, decode, save. One text
    encoding serves as both conditionings: on a CPU it costs as much as the sampling of a 64x64 image."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": synth.CHECKPOINT_NAME}},
        "2": {"class_type": "LoRAStackFromJSON", "inputs": {"stack_json": json.dumps(stack)}},
        "5": {"class_type": "MultiLoRALoader", "inputs": {"model": ["1", 0], "clip": ["1", 1],
                                                          "lora_stack": ["2", 0], "max_loras": 0}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["5", 1], "text": "a lighthouse at dusk"}},
        "8": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "9": {"class_type": "KSampler", "inputs": {"model": ["5", 0], "positive": ["6", 0], "negative": ["6", 0],
                                                   "latent_image": ["8", 0], "seed": seed, "steps": steps,
                                                   "cfg": 2.0, "sampler_name": "euler", "scheduler": "normal",
                                                   "denoise": 1.0}},
        "10": {"class_type": "VAEDecode", "inputs": {"samples": ["9", 0], "vae": ["1", 2]}},
        "11": {"class_type": "SaveImage", "inputs": {"images": ["10", 0], "filename_prefix": prefix}},
    }


def random_stack(rng: random.Random, loras: list[LoraFile]) -> list[dict]:
    picked = rng.sample(loras, rng.randint(1, min(4, len(loras))))
    strength = lambda lo, hi: 0.0 if rng.random() < 0.1 else round(rng.uniform(lo, hi), 2)  # noqa: E731
    return [{"name": lo.name, "strength_model": strength(-1.5, 1.5), "strength_clip": strength(-1.0, 1.0)}
            for lo in picked]


# -- state checks -------------------------------------------------------------------------------------

def check_status(st: dict, *, max_banks: int | None = 2, only_ours: bool = False) -> list[str]:
    """Problems in one GET /multilora/status answer; empty when the state is consistent.

    `max_banks`: one bank per model part (diffusion model, text encoder) on a server that runs one model
    (None: no limit). `only_ours`: check weight patches only on models that carry a stack of this pack
    (a server that also runs stock LoRA loaders)."""
    problems = []
    c = st["cache"]
    entry_bytes = sum(e["bytes"] for e in c["entries"])
    if c["bytes"] != entry_bytes:
        problems.append(f"cache bytes {c['bytes']} != sum of its entries' bytes {entry_bytes}")
    if c["items"] != len(c["entries"]):
        problems.append(f"cache items {c['items']} != {len(c['entries'])} entries")
    if c["bytes"] > c["max_bytes"] or c["items"] > c["max_items"]:
        problems.append(f"cache over budget: {c['items']} items / {c['bytes']} bytes, "
                        f"limits {c['max_items']} / {c['max_bytes']}")
    banks = st["banks"]
    if max_banks is not None and len(banks) > max_banks:
        problems.append(f"{len(banks)} slot banks alive (one per model part expected): "
                        f"{[b['model'] for b in banks]}")
    for b in banks:
        used = sum(s is not None for s in b["slots"])
        if len(b["slots"]) != b["max_loras"] or used > b["max_loras"]:
            problems.append(f"bank {b['model']}: {len(b['slots'])} slots listed, {used} used, "
                            f"max_loras {b['max_loras']}")
    h = st.get("hooks")
    if h is None:
        problems.append("status has no 'hooks' (nodes/routes.py is older than this check)")
    elif h["forward_hooks"] != h["layers"]:
        problems.append(f"{h['forward_hooks']} engine forward hooks on the modules but the banks hold "
                        f"{h['layers']} layers")
    for m in st["loaded_models"]:
        if (m["weight_patches"] or m["weight_backups"]) and (m["stack"] or not only_ours):
            problems.append(f"{m['model']}: {m['weight_patches']} weight patches, {m['weight_backups']} backups")
    return problems


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- the run ------------------------------------------------------------------------------------------

@dataclass
class Result:
    rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    budget_bytes: int = 0
    rss_slack_bytes: int = 0
    files_bytes: int = 0

    @property
    def rss(self) -> list[int]:
        return [r["rss_bytes"] for r in self.rows]

    def rss_limit_at(self, row: dict) -> int:
        slot_growth = max(0, row["bank_bytes"] - self.rows[0]["bank_bytes"])
        return self.rss[0] + self.budget_bytes + slot_growth + self.rss_slack_bytes

    @property
    def rss_limit(self) -> int:
        return max(self.rss_limit_at(r) for r in self.rows)

    @property
    def over_limit(self) -> list[dict]:
        return [r for r in self.rows if r["rss_bytes"] > self.rss_limit_at(r)]

    def summary(self) -> dict:
        rss, last = self.rss, self.rows[-1]
        secs = [r["seconds"] for r in self.rows]
        return {
            "prompts": len(self.rows), "lora_files_bytes": self.files_bytes, "cache_budget_bytes": self.budget_bytes,
            "rss_first_prompt_mib": round(rss[0] / MIB, 1), "rss_max_mib": round(max(rss) / MIB, 1),
            "rss_end_mib": round(rss[-1] / MIB, 1), "rss_limit_mib": round(self.rss_limit / MIB, 1),
            "rss_slack_mib": round(self.rss_slack_bytes / MIB, 1),
            "slot_bytes_first": self.rows[0]["bank_bytes"],
            "cache": {k: last[f"cache_{k}"] for k in ("hits", "misses", "evictions", "items", "bytes")},
            "banks": last["banks"], "bank_bytes_max": max(r["bank_bytes"] for r in self.rows),
            "hooks_end": last["forward_hooks"], "layers_end": last["layers"],
            "seconds_per_prompt_median": round(sorted(secs)[len(secs) // 2], 2),
            "seconds_total": round(sum(secs), 1), "problems": self.problems[:50], "ok": self.ok,
        }

    @property
    def ok(self) -> bool:
        return not self.problems and not self.over_limit


def soak(server: cs.ComfyServer, loras: list[LoraFile], prompts: int, *, budget_bytes: int, rss_slack_bytes: int,
         seed: int = 0, timeout: float = 300.0, max_seconds: float | None = None,
         progress: Callable[[dict], None] | None = None) -> Result:
    """Queue `prompts` random stacks one after another on `server` (fewer when `max_seconds` run out);
    sample and check after each."""
    rng = random.Random(seed)
    pid = server.proc.pid
    res = Result(budget_bytes=budget_bytes, rss_slack_bytes=rss_slack_bytes,
                 files_bytes=sum(lo.size for lo in loras))
    stop_at = time.monotonic() + max_seconds if max_seconds else None
    for i in range(prompts):
        if stop_at is not None and time.monotonic() > stop_at and res.rows:
            res.problems.append(f"stopped after {i} of {prompts} prompts: the {max_seconds:.0f} s limit ran out")
            break
        stack = random_stack(rng, loras)
        t0 = time.monotonic()
        server.run(prompt(stack, seed=rng.randrange(2**31), steps=rng.choice((1, 2))), timeout=timeout)
        seconds = time.monotonic() - t0
        rss = rss_bytes(pid)
        st = server.get_json("/multilora/status")
        for p in check_status(st):
            res.problems.append(f"prompt {i}: {p}")
        c, banks, hooks = st["cache"], st["banks"], st.get("hooks") or {}
        row = {
            "prompt": i, "seconds": round(seconds, 3), "stack_size": len(stack),
            "stack": ";".join(f"{e['name']}:{e['strength_model']}/{e['strength_clip']}" for e in stack),
            "rss_bytes": rss, "rss_mib": round(rss / MIB, 1),
            **{f"cache_{k}": c[k] for k in ("hits", "misses", "evictions", "items", "bytes")},
            "banks": len(banks), "bank_bytes": sum(b["bytes"] for b in banks),
            "slots_used": sum(s is not None for b in banks for s in b["slots"]),
            "max_loras": max((b["max_loras"] for b in banks), default=0),
            "layers": hooks.get("layers", -1), "forward_hooks": hooks.get("forward_hooks", -1),
        }
        res.rows.append(row)
        if progress:
            progress(row)
    for r in res.over_limit[:1]:
        res.problems.append(f"resident size {r['rss_mib']} MiB at prompt {r['prompt']} exceeds the first prompt's "
                            f"{res.rows[0]['rss_mib']} MiB + cache budget {budget_bytes / MIB:.1f} MiB + slot growth "
                            f"{(r['bank_bytes'] - res.rows[0]['bank_bytes']) / MIB:.1f} MiB + slack "
                            f"{rss_slack_bytes / MIB:.0f} MiB")
    return res


def write_artifacts(res: Result, csv_path: Path, json_path: Path | None = None) -> None:
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(res.rows[0]))
        w.writeheader()
        w.writerows(res.rows)
    if json_path is not None:
        json_path.write_text(json.dumps(res.summary(), indent=2) + "\n")


def print_summary(res: Result) -> None:
    s = res.summary()
    print(f"[soak] {s['prompts']} prompts in {s['seconds_total']} s (median {s['seconds_per_prompt_median']} s); "
          f"LoRA files {s['lora_files_bytes'] / MIB:.1f} MiB, cache budget {s['cache_budget_bytes'] / MIB:.1f} MiB")
    print(f"[soak] RSS first prompt {s['rss_first_prompt_mib']} MiB, max {s['rss_max_mib']} MiB, end "
          f"{s['rss_end_mib']} MiB; limit {s['rss_limit_mib']} MiB (first + budget + slot growth "
          f"{(s['bank_bytes_max'] - s['slot_bytes_first']) / MIB:.1f} MiB + {s['rss_slack_mib']} MiB)")
    print(f"[soak] cache {s['cache']}; banks {s['banks']} (slots {s['slot_bytes_first'] / MIB:.1f} MiB at the first "
          f"prompt, max {s['bank_bytes_max'] / MIB:.1f} MiB); "
          f"forward hooks {s['hooks_end']} = layers {s['layers_end']}")
    print(f"[soak] {'OK' if s['ok'] else 'FAILED'}" + "".join(f"\n[soak]   {p}" for p in s["problems"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--loras", type=int, default=30)
    ap.add_argument("--budget-mb", type=float, default=None,
                    help="engine cache budget in MiB (default: a quarter of the LoRA files' total)")
    ap.add_argument("--max-items", type=int, default=64, help="engine cache item limit")
    ap.add_argument("--rss-slack-mb", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop early (and fail) after this long")
    ap.add_argument("--out", type=Path, default=ARTIFACTS / "soak.csv")
    ns = ap.parse_args(argv)

    found = comfy()
    if found is None:
        return 2
    root, python, assets = found
    loras = make_loras(ns.loras, root, python)
    total = sum(lo.size for lo in loras)
    budget = int(ns.budget_mb * MIB) if ns.budget_mb is not None else total // 4
    print(f"[soak] {len(loras)} LoRA files, {total / MIB:.1f} MiB; cache budget {budget / MIB:.1f} MiB, "
          f"{ns.max_items} items")
    work = Path(tempfile.mkdtemp(prefix="multilora-soak-"))
    models = models_dir(work / "models", assets["checkpoint"], loras)
    env = {"MULTILORA_CACHE_MAX_BYTES": str(budget), "MULTILORA_CACHE_MAX_ITEMS": str(ns.max_items)}

    ns.out.parent.mkdir(parents=True, exist_ok=True)
    curve = open(ns.out, "w", newline="")
    writer = None

    def progress(row):
        nonlocal writer
        if writer is None:
            writer = csv.DictWriter(curve, fieldnames=list(row))
            writer.writeheader()
        writer.writerow(row)  # the curve so far survives a crash or an interrupted run
        curve.flush()
        if row["prompt"] % 10 == 0 or row["prompt"] == ns.prompts - 1:
            print(f"[soak] prompt {row['prompt']:4d}: {row['seconds']:.2f} s, RSS {row['rss_mib']} MiB, cache "
                  f"{row['cache_items']} items / {row['cache_bytes'] / MIB:.1f} MiB, "
                  f"{row['cache_evictions']} evictions", flush=True)

    srv = cs.ComfyServer(comfy_root=root, python=python, models_dir=models, workdir=work / "comfy", env=env)
    try:
        srv.start()
        res = soak(srv, loras, ns.prompts, budget_bytes=budget, rss_slack_bytes=int(ns.rss_slack_mb * MIB),
                   seed=ns.seed, max_seconds=ns.max_minutes * 60 if ns.max_minutes else None, progress=progress)
    except BaseException:
        print(f"[soak] failed; server log: {srv.log_path}", file=sys.stderr)
        raise
    finally:
        srv.stop()
        curve.close()
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    write_artifacts(res, ns.out, ns.out.with_suffix(".json"))
    print_summary(res)
    print(f"[soak] curve: {ns.out}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
