"""The order in which the pack's router tries workers for a prompt (serve/ranking.py): files held, within a slack of
the least loaded, and files no worker holds divided among the workers."""

from __future__ import annotations

import random

from serve.ranking import Worker, home, rank

BASE = frozenset({"checkpoints/sd15.safetensors"})


def w(name: str, queue: int = 0, room: bool = True, bases=BASE, loras=()) -> Worker:
    return Worker(name, queue, room, frozenset(bases), frozenset(loras))


def test_a_prompt_goes_to_the_worker_holding_most_of_its_loras_among_the_least_loaded():
    workers = [w("a", loras={"x"}), w("b", loras={"x", "y"}), w("c")]
    assert rank(BASE, frozenset({"x", "y", "z"}), workers) == ["b", "a", "c"]


def test_a_missing_base_model_outweighs_any_number_of_missing_loras():
    workers = [w("a", bases=(), loras={"x", "y", "z"}), w("b")]
    assert rank(BASE, frozenset({"x", "y", "z"}), workers)[0] == "b"


def test_the_slack_says_how_much_longer_a_holder_s_queue_may_be():
    workers = [w("holder", queue=1, loras={"x"}), w("idle", queue=0)]
    assert rank(BASE, frozenset({"x"}), workers, slack=0) == ["idle", "holder"]
    assert rank(BASE, frozenset({"x"}), workers, slack=1) == ["holder", "idle"]
    # a full holder is tried after every worker with room, whatever the slack
    full = [w("holder", queue=2, room=False, loras={"x"}), w("busy", queue=1)]
    assert rank(BASE, frozenset({"x"}), full, slack=5) == ["busy", "holder"]


def test_with_no_worker_warm_a_prompt_goes_where_it_evicts_least_a_new_worker_first():
    workers = [w("old", loras={"p", "q", "r"}), w("new", bases=())]
    assert rank(frozenset(), frozenset({"s"}), workers)[0] == "new"


def test_files_no_worker_holds_are_divided_among_the_workers_and_stay_home():
    names = [f"w{i}" for i in range(4)]
    files = [f"lora_{i:03d}.safetensors" for i in range(400)]
    homes = {f: home(f, names) for f in files}
    counts = {n: sum(1 for h in homes.values() if h == n) for n in names}
    assert all(60 <= c <= 140 for c in counts.values()), counts  # about a quarter each
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    assert all(home(f, shuffled) == homes[f] for f in files)  # the same in any order, in any process
    gone = names[1:]
    moved = [f for f in files if home(f, gone) != homes[f]]
    assert moved and all(homes[f] == names[0] for f in moved)  # a worker gone moves its own files only
    empty = [w(n) for n in names]
    for f in files[:40]:  # equal workers: a prompt of one cold file goes to its home
        assert rank(BASE, frozenset({f}), empty)[0] == homes[f]


def test_no_workers_and_no_files():
    assert rank(BASE, frozenset({"x"}), []) == []
    assert rank(frozenset(), frozenset(), [w("a", queue=1), w("b")]) == ["b", "a"]
