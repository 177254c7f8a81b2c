"""The pack's Ray Serve request router: each prompt to the worker that holds the most of its files, among the least
loaded (`serve/ranking.py`).

What a worker holds, the router learns two ways: the worker reports its `GET /multilora/resident` through Ray's
routing stats (`ComfyWorker.record_routing_stats`, every `STATS_PERIOD_S`), and the router adds the files of each
prompt it sends there since, for as long as the next report may take (a file sent is read by the time its prompt
runs). A worker's queue is Ray's count of its ongoing requests, one per prompt queued or running on it, where Ray's
cache of it is fresh (it forgets a count it has not updated for 10 s, `RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S`: a
worker sampling one long prompt); else the prompts this router sent it that have not completed. The files of a prompt
come with its request (`ComfyWorker.run`'s `files`), as the ingress computed them (`prompt_files`).
"""

from __future__ import annotations

import time

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .ranking import Worker, rank

STATS_PERIOD_S = 2.0  # between two reports of a worker's resident files (Ray's default is 10 s)
RECENT_S = 2 * STATS_PERIOD_S + 1.0  # a file sent to a worker counts as held until a report has surely come since


class FileRouter(FIFOMixin, RequestRouter):
    """Ranks the workers for each prompt by the files of it they hold, within `slack` prompts of the shortest queue;
    Ray tries them in that order and takes the first with room."""

    def initialize_state(self, slack: int = 0, **_) -> None:
        self.slack = int(slack)
        # worker → (kind, file) → when a prompt needing it was sent there; kind is "bases" or "loras"
        self.sent: dict[ReplicaID, dict[tuple[str, str], float]] = {}
        # worker → the requests this router sent it that have not completed (Ray also reports the completion of a
        # request the worker refused, which was never routed: hence ids, not a count)
        self.ongoing: dict[ReplicaID, set[str]] = {}

    @staticmethod
    def files(pending_request: PendingRequest | None) -> tuple[frozenset[str], frozenset[str]]:
        """The (base model files, LoRA files) a request's prompt needs; none for a request that names none."""
        files = (pending_request.kwargs.get("files") if pending_request is not None else None) or {}
        return frozenset(files.get("bases", ())), frozenset(files.get("loras", ()))

    def _held(self, replica: RunningReplica, kind: str) -> frozenset[str]:
        reported = (replica.routing_stats or {}).get(kind, ())
        now = time.monotonic()
        sent = {f for (k, f), at in self.sent.get(replica.replica_id, {}).items() if k == kind and now - at < RECENT_S}
        return frozenset(reported) | sent

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        bases, loras = self.files(pending_request)
        if pending_request is not None:
            # Every worker is ranked at once: where none has room, Ray is to wait (back off) before asking again,
            # not ask again at once (it loops without a pause unless told).
            pending_request.routing_context.should_backoff = True
        by_name, views = {}, []
        for r in candidate_replicas:
            queue = self.replica_queue_len_cache.get(r.replica_id)
            queue = len(self.ongoing.get(r.replica_id, ())) if queue is None else queue
            name = r.replica_id.unique_id
            by_name[name] = r
            views.append(Worker(name, queue, queue < r.max_ongoing_requests, self._held(r, "bases"),
                                self._held(r, "loras")))
        return [[by_name[name]] for name in rank(bases, loras, views, self.slack)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        bases, loras = self.files(pending_request)
        now = time.monotonic()
        sent = self.sent.setdefault(replica_id, {})
        for old in [key for key, at in sent.items() if now - at >= RECENT_S]:
            del sent[old]
        sent.update({("bases", f): now for f in bases})
        sent.update({("loras", f): now for f in loras})
        self.ongoing.setdefault(replica_id, set()).add(pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ongoing.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.sent.pop(replica_id, None)
        self.ongoing.pop(replica_id, None)
