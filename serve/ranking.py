"""The order in which the pack's router tries workers for a prompt: the files it needs that each holds, within a
slack of the least loaded.

A worker is described by what the router knows of it (`Worker`): its queue, whether it has room, and the base
model files and LoRA files it holds. For a prompt that needs `bases` and `loras`, the workers with room whose queue
is at most `slack` longer than the shortest come first, ordered by
1. the base model files they lack (a base model costs seconds to load; a LoRA file a fraction of one),
2. the LoRA files they lack,
3. their queue,
4. the LoRA files they hold (a prompt no worker is warm for goes where it evicts least: a new worker first),
5. how many of the prompt's files that no worker holds call them home, base models first (rendezvous hashing:
   each file has one home among the workers, the same in every process, and moves only when its home goes), so
   that such files are divided among the workers rather than read by each;
then the other workers with room, by queue; then the full ones. No Ray here: `serve/router.py` feeds it what Ray
and the workers report, and `bench/serve_sim.py` simulates the same rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Worker:
    """What the router knows of one worker."""

    name: str
    queue: int
    room: bool
    bases: frozenset[str] = frozenset()
    loras: frozenset[str] = frozenset()


def home(file: str, names: Iterable[str]) -> str:
    """The worker of `names` that `file` calls home: the highest sha256 of the two (rendezvous hashing)."""
    return max(names, key=lambda n: hashlib.sha256(f"{n}\0{file}".encode()).digest())


def rank(bases: frozenset[str], loras: frozenset[str], workers: Sequence[Worker], slack: int = 0) -> list[str]:
    """The names of `workers` in the order to try them for a prompt needing `bases` and `loras` (module docstring)."""
    if not workers:
        return []
    names = [w.name for w in workers]
    homes = {w.name: [0, 0] for w in workers}  # cold base models, cold LoRA files that call the worker home
    for kind, files in enumerate((bases, loras)):
        for f in files:
            if not any(f in (w.bases, w.loras)[kind] for w in workers):
                homes[home(f, names)][kind] += 1
    with_room = [w for w in workers if w.room]
    least = min((w.queue for w in with_room), default=0)
    near = [w for w in with_room if w.queue <= least + slack]
    near.sort(key=lambda w: (len(bases - w.bases), len(loras - w.loras), w.queue, len(w.loras),
                             [-n for n in homes[w.name]], w.name))
    rest = sorted((w for w in workers if w not in near), key=lambda w: (not w.room, w.queue, w.name))
    return [w.name for w in near + rest]
