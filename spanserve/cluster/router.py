"""The span-aware request router: a request goes where most of its KV blocks already are.

Each replica publishes the keys of the blocks it holds (replica.py, `routing_stats`); each request
carries its own keys (keys.py, the `keys` argument of the replica call). A replica's score is the
number of the request's keys it holds, less `load_weight` per request it is running or queueing;
the best comes first, alone, then the others by score (Serve takes the first group with room),
except that a replica sent more than `load_bound` times the mean of the requests routed lately
comes after all the others (`ranked`: bounded-load balancing).
A request no replica holds anything of goes by power of two choices, as Serve's default router.
A session's calls name their replica (`pin`) and go nowhere else while it lives. Replicas the
ingress saw die (`avoid`) get nothing until Serve drops them.

Published keys lag by up to a stats period, so the router also remembers, for `memory_s`, the
keys of the requests it sent each replica: the second of two requests sharing documents sent
back to back follows the first. Nothing here waits on Ray: the scores read what is at hand.

Each routed request is counted by replica and reason (routing_state.py, in the ingress's /metrics).
"""

import math
import random
import time
from collections import deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from spanserve.cluster import routing_state

LOAD_WEIGHT = 4.0  # blocks of cached prompt that one queued request outweighs
LOAD_BOUND = 1.5  # a replica sent more than this times the mean of the recent requests comes last
MAX_PENDING_REASONS = 10_000  # why-routed notes of requests not routed yet (cancelled ones never are)


def score(hits: int, load: int, load_weight: float = LOAD_WEIGHT) -> float:
    """Blocks of the request a replica holds, less `load_weight` per request it is busy with."""
    return hits - load_weight * load


def ranked(hits: list[int], loads: list[int], recent: list[int], load_weight: float = LOAD_WEIGHT,
           load_bound: float = LOAD_BOUND, rng: random.Random | None = None) -> list[int]:
    """Replica indices, best first: by score among those that were sent at most `load_bound` times
    the mean of the requests routed lately (`recent`, this one included, rounded up), then the
    others by score. The bound (bounded-load balancing) keeps a replica that holds the popular
    documents from taking every request for them; the score's load term keeps queues short."""
    cap = math.ceil(load_bound * (sum(recent) + 1) / len(recent))
    tie = (rng or random).sample(range(len(loads)), len(loads))  # ties (a system prompt every replica holds) at random
    order = sorted(range(len(loads)), key=lambda i: (-score(hits[i], loads[i], load_weight), loads[i], tie[i]))
    return [i for i in order if recent[i] + 1 <= cap] + [i for i in order if recent[i] + 1 > cap]


def pinned_or_alive(candidates: list[RunningReplica], kwargs: dict) -> tuple[list[RunningReplica], list]:
    """The candidates less those the ingress saw die (`avoid`), and the replica a call is pinned to
    if it is among them (a session's call waits for room there rather than going elsewhere; if its
    replica is gone, another tells the ingress so, which restores the session there)."""
    avoid, pin = kwargs.get("avoid") or (), kwargs.get("pin")
    alive = [r for r in candidates if r.replica_id.unique_id not in avoid] or candidates
    return alive, [r for r in alive if r.replica_id.unique_id == pin] if pin is not None else []


def _load(replica: RunningReplica) -> int:
    return replica.routing_stats.get("load", 0)  # {} until the replica's first stats


class SpanAwareRouter(RequestRouter):
    def initialize_state(self, load_weight: float = LOAD_WEIGHT, load_bound: float = LOAD_BOUND,
                         memory_s: float = 5.0, **kwargs):
        self.load_weight, self.load_bound, self.memory_s = load_weight, load_bound, memory_s
        self._sent: dict[str, deque[tuple[float, list[str]]]] = {}  # replica -> (when, keys) routed to it
        self._published: dict[str, tuple[list[str], frozenset[str]]] = {}  # replica -> its keys, as a set
        self._reasons: dict[str, str] = {}  # request id -> why it goes where choose_replicas said
        routing_state.ROUTERS.add(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        began = time.perf_counter()
        try:
            return self._rank(candidate_replicas, pending_request)
        finally:
            routing_state.CHOICE_SECONDS.observe(time.perf_counter() - began)

    def _rank(self, candidate_replicas: list[RunningReplica],
              pending_request: PendingRequest) -> list[list[RunningReplica]]:
        pending_request.routing_context.should_backoff = True  # the groups below are all there is
        kwargs, request_id = pending_request.kwargs, pending_request.metadata.request_id
        if len(self._reasons) > MAX_PENDING_REASONS:  # requests cancelled before routing leave theirs
            self._reasons.clear()
        candidates, pinned = pinned_or_alive(candidate_replicas, kwargs)
        if kwargs.get("pin") is not None:
            self._reasons[request_id] = "pinned"
        if pinned:
            return [pinned]
        keys = kwargs.get("keys") or []
        hits = {r.replica_id: len(self._held(r).intersection(keys)) for r in candidates} if keys else {}
        if any(hits.values()):
            self._reasons.setdefault(request_id, "cache")
            loads, recent = [_load(r) for r in candidates], [len(self._recent(r)) for r in candidates]
            order = [candidates[i] for i in ranked([hits[r.replica_id] for r in candidates], loads, recent,
                                                   self.load_weight, self.load_bound)]
            return [order[:1], order[1:]] if len(order) > 1 else [order]
        self._reasons.setdefault(request_id, "load")
        return [random.sample(candidates, min(2, len(candidates)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        reason = self._reasons.pop(pending_request.metadata.request_id, "load")
        routing_state.ROUTED.labels(replica_id.unique_id, reason).inc()
        keys = pending_request.kwargs.get("keys")
        if keys:
            self._sent.setdefault(replica_id.unique_id, deque()).append((time.monotonic(), keys))

    def _recent(self, replica: RunningReplica) -> deque[tuple[float, list[str]]]:
        """(when, keys) of the requests routed to the replica in the last `memory_s`."""
        sent = self._sent.setdefault(replica.replica_id.unique_id, deque())
        while sent and sent[0][0] < time.monotonic() - self.memory_s:
            sent.popleft()
        return sent

    def _held(self, replica: RunningReplica) -> set[str]:
        """The keys the replica published, and those of the requests sent to it lately."""
        rid, published = replica.replica_id.unique_id, replica.routing_stats.get("keys", [])
        cached = self._published.get(rid)
        if cached is None or cached[0] is not published:  # a new stats dict arrived: build its set once
            cached = self._published[rid] = (published, frozenset(published))
        sent = self._recent(replica)
        return cached[1].union(*(keys for _, keys in sent)) if sent else cached[1]
