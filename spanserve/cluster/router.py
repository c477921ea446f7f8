"""The span-aware request router: a request goes where most of its KV blocks already are.

Each replica publishes the keys of the blocks it holds (replica.py, `routing_stats`); each request
carries its own keys (keys.py, the `keys` argument of the replica call). A replica's score is the
number of the request's keys it holds, less `load_weight` per request it is running or queueing;
the best comes first, alone, then the others by score (Serve takes the first group with room).
A request no replica holds anything of goes by power of two choices, as Serve's default router.
A session's calls name their replica (`pin`) and go nowhere else while it lives. Replicas the
ingress saw die (`avoid`) get nothing until Serve drops them.

Published keys lag by up to a stats period, so the router also remembers, for `memory_s`, the
keys of the requests it sent each replica: the second of two requests sharing documents sent
back to back follows the first. Nothing here waits on Ray: the scores read what is at hand.

Each routed request is counted by replica and reason (routing_state.py, in the ingress's /metrics).
"""

import random
import time
from collections import deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from spanserve.cluster import routing_state

MAX_PENDING_REASONS = 10_000


def score(hits: int, load: int, load_weight: float) -> float:
    """Blocks of the request a replica holds, less `load_weight` per request it is busy with."""
    return hits - load_weight * load


def _load(replica: RunningReplica) -> int:
    return replica.routing_stats.get("load", 0)  # {} until the replica's first stats


class SpanAwareRouter(RequestRouter):
    def initialize_state(self, load_weight: float = 4.0, memory_s: float = 5.0, **kwargs):
        self.load_weight, self.memory_s = load_weight, memory_s
        self._sent: dict[str, deque[tuple[float, list[str]]]] = {}  # replica -> (when, keys) routed to it
        self._published: dict[str, tuple[list[str], frozenset[str]]] = {}  # replica -> its keys, as a set
        self._reasons: dict[str, str] = {}  # request id -> why it goes where choose_replicas said
        routing_state.ROUTERS.add(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # the groups below are all there is
        kwargs, request_id = pending_request.kwargs, pending_request.metadata.request_id
        if len(self._reasons) > MAX_PENDING_REASONS:  # requests cancelled before routing leave theirs
            self._reasons.clear()
        avoid = kwargs.get("avoid") or ()
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        pin = kwargs.get("pin")
        if pin is not None:
            pinned = [r for r in candidates if r.replica_id.unique_id == pin]
            self._reasons[request_id] = "pinned"
            if pinned:
                return [pinned]  # waits for room there rather than going elsewhere
            # its replica is gone: another tells the ingress so, which restores the session there
        keys = kwargs.get("keys") or []
        hits = {r.replica_id: len(self._held(r).intersection(keys)) for r in candidates} if keys else {}
        if any(hits.values()):
            self._reasons.setdefault(request_id, "cache")
            ranked = sorted(candidates, key=lambda r: -score(hits[r.replica_id], _load(r), self.load_weight))
            return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
        self._reasons.setdefault(request_id, "load")
        return [random.sample(candidates, min(2, len(candidates)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        reason = self._reasons.pop(pending_request.metadata.request_id, "load")
        routing_state.ROUTED.labels(replica_id.unique_id, reason).inc()
        keys = pending_request.kwargs.get("keys")
        if keys:
            self._sent.setdefault(replica_id.unique_id, deque()).append((time.monotonic(), keys))

    def _held(self, replica: RunningReplica) -> set[str]:
        """The keys the replica published, and those of the requests sent to it lately."""
        rid, published = replica.replica_id.unique_id, replica.routing_stats.get("keys", [])
        cached = self._published.get(rid)
        if cached is None or cached[0] is not published:  # a new stats dict arrived: build its set once
            cached = self._published[rid] = (published, frozenset(published))
        sent = self._sent.get(rid)
        if not sent:
            return cached[1]
        while sent and sent[0][0] < time.monotonic() - self.memory_s:
            sent.popleft()
        return cached[1].union(*(keys for _, keys in sent))
