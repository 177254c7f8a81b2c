"""The pack's Ray request router (serve/router.py) as Ray calls it: the queue it ranks each worker by, and the files
it believes a worker holds. Ray's own router class, fed workers as Ray describes them; no cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.request_router import ReplicaID

from serve.router import FileRouter

DEPLOYMENT = DeploymentID(name="ComfyWorker", app_name="multilora")


def router() -> FileRouter:
    r = FileRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    r.initialize_state(slack=0)
    return r


def worker(name: str, loras=()) -> SimpleNamespace:
    """A running replica as the router reads it: its id, its room, and the files it last reported."""
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), max_ongoing_requests=2,
                           routing_stats={"bases": [], "loras": list(loras)})


def prompt(request_id: str, loras=()) -> SimpleNamespace:
    """A pending request as Ray hands it over: the files the ingress computed, and Ray's id for the request."""
    return SimpleNamespace(kwargs={"files": {"bases": [], "loras": list(loras)}},
                           metadata=SimpleNamespace(internal_request_id=request_id),
                           routing_context=SimpleNamespace(should_backoff=False))


def order(r: FileRouter, workers, pending) -> list[str]:
    ranks = asyncio.run(r.choose_replicas(workers, pending))
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_a_worker_whose_queue_ray_has_forgotten_counts_the_prompts_sent_to_it_and_not_completed():
    # Ray's cache forgets a count it has not updated for 10 s: a worker sampling one long prompt
    r = router()
    holder, idle = worker("holder", loras={"x"}), worker("idle")
    r.replica_queue_len_cache.update(idle.replica_id, 0)
    assert order(r, [holder, idle], prompt("p0", {"x"})) == ["holder", "idle"]  # both idle: the holder first

    r.on_request_routed(prompt("p1", {"x"}), holder.replica_id, None)  # Ray's cache of the holder is never updated
    assert order(r, [holder, idle], prompt("p2", {"x"})) == ["idle", "holder"]

    r.on_request_completed(holder.replica_id, "refused")  # a request the holder refused, never routed: no change
    assert order(r, [holder, idle], prompt("p2", {"x"})) == ["idle", "holder"]

    r.on_request_completed(holder.replica_id, "p1")
    assert order(r, [holder, idle], prompt("p2", {"x"})) == ["holder", "idle"]


def test_ray_s_fresh_count_outweighs_the_router_s_own():
    r = router()
    holder, idle = worker("holder", loras={"x"}), worker("idle")
    r.on_request_routed(prompt("p1", {"x"}), holder.replica_id, None)
    r.replica_queue_len_cache.update(holder.replica_id, 0)  # the prompt is done by Ray's latest word
    r.replica_queue_len_cache.update(idle.replica_id, 0)
    assert order(r, [holder, idle], prompt("p2", {"x"})) == ["holder", "idle"]


def test_a_file_sent_to_a_worker_counts_as_held_there_before_its_report_and_a_dead_worker_holds_nothing():
    r = router()
    a, b = worker("a"), worker("b")
    for w in (a, b):
        r.replica_queue_len_cache.update(w.replica_id, 0)
    r.on_request_routed(prompt("p1", {"y"}), b.replica_id, None)
    r.replica_queue_len_cache.update(b.replica_id, 0)
    assert order(r, [a, b], prompt("p2", {"y"}))[0] == "b"
    r.on_replica_actor_died(b.replica_id)
    assert r.sent.get(b.replica_id) is None and r.ongoing.get(b.replica_id) is None
