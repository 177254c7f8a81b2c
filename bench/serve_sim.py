"""Routing at 2, 8 and 64 workers, simulated: the trace of bench/serve_bench.py, the pack's router and Ray Serve's
routings as docs/serve.md states them, and the costs serve_bench.py measured.

    python bench/serve_sim.py --costs serve.json                  # the figures of docs/serve.md
    python bench/serve_sim.py --warm-s 3.1 --file-s 0.4 --workers 2,8,64 --library 24,240

No ComfyUI and no Ray: an event simulation, any python. Each worker takes `--queue` prompts at once and samples one
at a time; a prompt costs the warm time, plus the cost of each of its LoRA files the worker's cache (an LRU of
`--cache` files) does not hold. The router, per arriving prompt:
- `files` (and `files, slack 1`): serve/ranking.py's order, given each worker's queue and the files its cache holds
  or its waiting prompts will read; the first worker if it has room;
- `affinity`: a worker holding the prompt's key with room (the shortest queue among them); else the workers holding
  the fewest keys, if one has room; else, once the prompt has waited the matching timeout (1 s), any worker with
  room. A worker holds the keys of the prompts it took, the last `--keys` of them. The key is serve/affinity.py's:
  the prompt's set of files;
- `homes`: the worker most of the prompt's files call home (serve/ranking.py's rendezvous hashing over all the
  workers), whatever the queues, waiting for it while it is full: the library divided among the workers once and
  for all, what a strict partition saves, at any cost in latency;
- `anchor`: as `affinity`, with one file of the set as the key (the first in a fixed hash order), so that sets that
  share files mostly share a key: a coarser key, for comparison;
- `no ids`: two workers drawn at random, the one with the shorter queue (Ray's power of two choices), if it has room;
- `all warm`: as `no ids`, with every file in every cache from the start: the limit.
A prompt that finds no worker waits in arrival order. Arrivals are Poisson at `--load` of the workers' capacity
(workers / warm time). Reads ahead are not modelled: a cold file costs its prompt its read. Printed per run: files
read per 100 prompts, the share of LoRA files found warm, p50 and p95 latency.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import random
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import make_trace  # noqa: E402  (the same generator as the measured trace; puts the repo on the path)

from serve import ranking  # noqa: E402  (the pack's router's own rule)

MATCHING_TIMEOUT_S = 1.0


class Worker:
    def __init__(self, cache: int, keys: int, warm: set[str] | None):
        self.cache: OrderedDict[str, None] = OrderedDict.fromkeys(sorted(warm or ()))
        self.cache_size = len(self.cache) if warm else cache
        self.keys: OrderedDict[frozenset, None] = OrderedDict()
        self.max_keys = keys
        self.waiting: list[int] = []  # prompts taken, not started
        self.running: int | None = None

    def load(self) -> int:
        return len(self.waiting) + (self.running is not None)

    def hold(self, key: frozenset) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.max_keys:
            self.keys.popitem(last=False)

    def read(self, files) -> int:
        cold = 0
        for f in sorted(files):  # a set's order follows the process's string hashing: sorted, the run repeats
            if f in self.cache:
                self.cache.move_to_end(f)
            else:
                cold += 1
                self.cache[f] = None
                while len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        return cold


def anchor(files: frozenset) -> frozenset:
    """The file of `files` first in a fixed hash order: sets that share files mostly share it."""
    return frozenset([min(files, key=lambda f: hashlib.sha256(f.encode()).digest())]) if files else files


def simulate(policy: str, trace, workers: int, args, rng: random.Random) -> dict:
    files_of = [frozenset(n for n, _ in stack) for stack in trace]
    key_of = [anchor(f) if policy == "anchor" else f for f in files_of]
    everything = set().union(*files_of)
    names = [str(k) for k in range(workers)]
    home_of = {f: int(ranking.home(f, names)) for f in everything} if policy == "homes" else {}
    pool = [Worker(args.cache, args.keys, everything if policy == "all warm" else None) for _ in range(workers)]
    rate = args.load * workers / args.warm_s
    t, arrivals = 0.0, []
    for _ in trace:
        t += rng.expovariate(rate)
        arrivals.append(t)
    events = [(a, 0, "arrive", i) for i, a in enumerate(arrivals)]
    heapq.heapify(events)
    pending: list[int] = []
    done, reads, seq = {}, 0, len(trace)

    def choose(i: int, now: float) -> Worker | None:
        room = [w for w in pool if w.load() < args.queue]
        if not room:
            return None
        if policy == "homes":  # the worker most of the prompt's files call home, whatever the queues
            votes = [home_of[f] for f in sorted(files_of[i])]
            w = pool[max(sorted(set(votes)), key=votes.count)] if votes else min(pool, key=Worker.load)
            return w if w.load() < args.queue else None
        if policy.startswith("files"):
            slack = 1 if policy.endswith("1") else 0
            views = [ranking.Worker(str(k), w.load(), w.load() < args.queue,
                                    loras=frozenset(w.cache).union(*(files_of[j] for j in w.waiting)))
                     for k, w in enumerate(pool)]
            first = pool[int(ranking.rank(frozenset(), files_of[i], views, slack)[0])]
            return first if first.load() < args.queue else None
        if policy not in ("affinity", "anchor"):
            a, b = rng.choice(pool), rng.choice(pool)
            pick = min((a, b), key=Worker.load)
            return pick if pick.load() < args.queue else None
        holders = [w for w in room if key_of[i] in w.keys]
        if holders:
            return min(holders, key=lambda w: (w.load(), rng.random()))
        fewest = min(len(w.keys) for w in pool)
        least = [w for w in room if len(w.keys) == fewest]
        if least:
            return rng.choice(least)
        return rng.choice(room) if now - arrivals[i] >= MATCHING_TIMEOUT_S else None

    def start(w: Worker, now: float) -> None:
        nonlocal reads, seq
        if w.running is None and w.waiting:
            i = w.waiting.pop(0)
            w.running = i
            cold = w.read(files_of[i])
            reads += cold
            seq += 1
            heapq.heappush(events, (now + args.warm_s + cold * args.file_s, seq, "finish", i))

    retry_at = None
    while events:
        now, _, kind, i = heapq.heappop(events)
        if kind == "arrive":
            pending.append(i)
        elif kind == "retry":
            retry_at = None
        else:
            done[i] = now
            for w in pool:
                if w.running == i:
                    w.running = None
                    start(w, now)
        placed = True
        while placed and pending:  # in arrival order; one that cannot be placed yet may let a later one by
            placed = False
            for i in list(pending):
                w = choose(i, now)
                if w is not None:
                    pending.remove(i)
                    w.waiting.append(i)
                    w.hold(key_of[i])
                    start(w, now)
                    placed = True
        if pending and retry_at is None:  # a prompt past its matching timeout may go to any worker with room
            seq += 1
            retry_at = now + MATCHING_TIMEOUT_S
            heapq.heappush(events, (retry_at, seq, "retry", -1))
    lat = sorted(done[i] - arrivals[i] for i in range(len(trace)))
    asked = sum(len(f) for f in files_of)
    return {"policy": policy, "workers": workers, "prompts": len(trace), "reads_per_100": round(100 * reads / len(trace), 1),
            "warm_share": round(1 - reads / asked, 3), "p50_s": round(statistics.median(lat), 2),
            "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", help="serve_bench.py's --out JSON: its warm prompt and cold file costs")
    ap.add_argument("--warm-s", type=float, default=None, help="a warm prompt's time on one worker")
    ap.add_argument("--file-s", type=float, default=None, help="what one cold LoRA file adds to a prompt")
    ap.add_argument("--workers", default="2,8,64")
    ap.add_argument("--library", default="24,240", help="LoRA files the trace draws from")
    ap.add_argument("--prompts", type=int, default=0, help="per run; default 120 and 60 per worker, each")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--queue", type=int, default=2)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--cache", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.costs:
        costs = json.loads(Path(args.costs).read_text())["cold_load"]
        args.warm_s = args.warm_s or costs["warm_s"]
        args.file_s = args.file_s or costs["file_s"]
    if args.warm_s is None or args.file_s is None:
        ap.error("give --costs, or --warm-s and --file-s")
    print(f"warm prompt {args.warm_s:.2f} s, cold file {args.file_s:.3f} s, load {args.load:.0%}, queue {args.queue}, "
          f"{args.keys} keys and {args.cache} files per worker")
    for library in (int(x) for x in args.library.split(",")):
        names = [f"lora_{i:03d}" for i in range(library)]
        for workers in (int(x) for x in args.workers.split(",")):
            for n in ([args.prompts] if args.prompts else [120, 60 * workers]):
                trace = make_trace(n, names, args.zipf, args.seed)
                for policy in ("files", "files, slack 1", "homes", "affinity", "anchor", "no ids", "all warm"):
                    row = simulate(policy, trace, workers, args, random.Random(args.seed + 1))
                    print(json.dumps({"library": library, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
