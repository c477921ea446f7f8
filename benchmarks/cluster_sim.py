"""A simulated cluster: many replicas' KV caches and queues, a trace replayed through each router.

`spanserve bench cluster` runs it at 16-256 replicas, where this machine cannot run real ones. It
replays a trace (cluster_trace.py) through the routers' decision rules and models what a replica
would do with each request:

- **Keys and cache.** A request's KV blocks are keyed with the engine's own hashing
  (cluster/keys.py `prompt_keys`: the context chain before the first span, each span's own chain).
  A replica keeps an LRU set of `capacity` block keys; a request routed there finds, in each chain,
  the leading blocks the set holds (as the engine's lookup does) and computes the rest of its
  prompt; then all its blocks are the newest in the set.
- **Queue and time.** A replica serves its requests one at a time in arrival order. A request
  takes `prompt computed / prefill_tps` seconds to its first token, then `decode_s` more. Its
  time to first token is its wait in the queue plus its prefill. Requests arrive as a Poisson
  process whose rate keeps the replicas `load` busy had nothing been cached.
- **Routers.** round-robin; pow2 (two replicas at random, the shorter queue); prefix (Ray's
  PrefixCacheAffinityRouter's rule on Ray's own PrefixTree: the replicas whose text matches the
  prompt's longest prefix when at least 10% of it matches, else those holding the fewest
  characters, the shorter queue among them; its default has no load threshold and no eviction);
  span (ours: router.py's `ranked`: the score of the keys a replica holds less `load_weight` per
  queued request, within its load bound; power of two when none holds any). The simulated span router sees
  each cache exactly, without the real one's publication lag and 4,096-key cap (a cache of
  `capacity` <= 4,096 blocks is then published whole).

Load skew is the busiest replica's time-averaged queue over the mean one's. Prefill tokens
computed and the cache-hit rate do not depend on the machine; times are the model's, except
`choice_p99_ms`: the span router's own time per request here (counting the keys each replica
holds and ranking them), on this machine.
"""

import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from benchmarks.cluster_trace import SimRequest
from spanserve.cluster.router import LOAD_BOUND, LOAD_WEIGHT, ranked

ROUTERS = ("round-robin", "pow2", "prefix", "span")


@dataclass
class SimConfig:
    replicas: int
    capacity: int = 2048  # KV blocks a replica caches
    prefill_tps: float = 2000.0  # prompt tokens a replica computes per second
    decode_s: float = 0.2  # time after the first token (a few tokens of answer)
    load: float = 0.6  # arrival rate: this share of the replicas' time, had nothing been cached
    load_weight: float = LOAD_WEIGHT  # the span router's (router.py)
    load_bound: float = LOAD_BOUND
    memory_s: float = 5.0  # the span router's window of recently routed requests (router.py)
    seed: int = 0


class _Replica:
    def __init__(self, capacity: int):
        self.cache: OrderedDict[str, None] = OrderedDict()
        self.capacity = capacity
        self.free_at = 0.0
        self.finishing: deque[float] = deque()  # finish times of the requests it holds, in order
        self.queue_area, self.last_t = 0.0, 0.0  # integral of its queue over time
        self.routed: deque[float] = deque()  # when requests with keys were routed here (the span router)

    def queue(self, now: float) -> int:
        self.queue_area += len(self.finishing) * (now - self.last_t)  # (a finish inside the step counts whole)
        self.last_t = now
        while self.finishing and self.finishing[0] <= now:
            self.finishing.popleft()
        return len(self.finishing)


class Cluster:
    """Replicas, their caches (with an index key -> replicas for the span router), and a router."""

    def __init__(self, config: SimConfig, router: str):
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}")
        self.config, self.router, self.rng = config, router, random.Random(config.seed)
        self.replicas = [_Replica(config.capacity) for _ in range(config.replicas)]
        self.holders: dict[str, set[int]] = {}  # key -> replicas whose cache holds it
        self.turn = 0
        self.choice_s: list[float] = []  # the span router's time per request (this machine's)
        if router == "prefix":
            from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

            self.tree = PrefixTree()
            self.tree.add_tenants([str(i) for i in range(config.replicas)], 0.0)

    def choose(self, req: SimRequest, now: float) -> int:
        queues = [r.queue(now) for r in self.replicas]
        if self.router == "round-robin":
            self.turn += 1
            return (self.turn - 1) % len(self.replicas)
        if self.router == "pow2":
            return self._shorter(self.rng.sample(range(len(self.replicas)), min(2, len(self.replicas))), queues)
        if self.router == "prefix":
            matched, owners = self.tree.prefix_match(req.text)
            if len(matched) < 0.1 * len(req.text) or not owners:
                owners = self.tree.get_smallest_tenants()
            chosen = self._shorter([int(t) for t in owners], queues)
            self.tree.insert(req.text, str(chosen), now)
            return chosen
        began = time.perf_counter()
        hits: dict[int, int] = {}
        for key in req.all_keys:
            for i in self.holders.get(key, ()):
                hits[i] = hits.get(i, 0) + 1
        if not hits:
            return self._shorter(self.rng.sample(range(len(self.replicas)), min(2, len(self.replicas))), queues)
        recent = []
        for replica in self.replicas:
            while replica.routed and replica.routed[0] < now - self.config.memory_s:
                replica.routed.popleft()
            recent.append(len(replica.routed))
        held = [hits.get(i, 0) for i in range(len(self.replicas))]
        chosen = ranked(held, queues, recent, self.config.load_weight, self.config.load_bound, self.rng)[0]
        self.replicas[chosen].routed.append(now)
        self.choice_s.append(time.perf_counter() - began)
        return chosen

    def _shorter(self, group: list[int], queues: list[int]) -> int:
        best = min(queues[i] for i in group)
        return self.rng.choice([i for i in group if queues[i] == best])

    def serve(self, i: int, req: SimRequest, now: float) -> tuple[int, float]:
        """Run `req` on replica i: (prompt tokens it computed, its time to first token)."""
        replica = self.replicas[i]
        cached = sum(_leading(chain, replica.cache) for chain in req.chains) * req.block_size
        computed = req.prompt_tokens - cached
        start = max(now, replica.free_at)
        first = start + computed / self.config.prefill_tps
        replica.free_at = first + self.config.decode_s
        replica.queue(now)
        replica.finishing.append(replica.free_at)
        self._insert(i, req.all_keys)
        return computed, first - now

    def _insert(self, i: int, keys: list[str]) -> None:
        cache = self.replicas[i].cache
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                self.holders.setdefault(key, set()).add(i)
        while len(cache) > self.config.capacity:
            old, _ = cache.popitem(last=False)
            owners = self.holders[old]
            owners.discard(i)
            if not owners:
                del self.holders[old]


def _leading(chain: list[str], cache) -> int:
    n = 0
    for key in chain:
        if key not in cache:
            break
        n += 1
    return n


def simulate(trace: list[SimRequest], config: SimConfig, router: str) -> dict:
    """Replay `trace` through one router: prefill tokens computed, hit rate, TTFT, load skew."""
    cluster = Cluster(config, router)
    rng = random.Random(config.seed + 1)
    uncached_s = sum(r.prompt_tokens for r in trace) / len(trace) / config.prefill_tps + config.decode_s
    rate = config.load * config.replicas / uncached_s  # arrivals per second
    now, computed, ttfts, prompt = 0.0, 0, [], 0
    for req in trace:
        now += rng.expovariate(rate)
        tokens, ttft = cluster.serve(cluster.choose(req, now), req, now)
        computed += tokens
        prompt += req.prompt_tokens
        ttfts.append(ttft)
    for replica in cluster.replicas:
        replica.queue(now)
    areas = [r.queue_area for r in cluster.replicas]
    mean_area = sum(areas) / len(areas)
    ttfts.sort()
    return {"router": router, "replicas": config.replicas, "requests": len(trace), "prompt_tokens": prompt,
            "prefill_tokens": computed, "hit_rate": round(1 - computed / prompt, 4),
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4), "ttft_p99_s": round(ttfts[int(len(ttfts) * 0.99)], 4),
            "load_skew": round(max(areas) / mean_area, 3) if mean_area else 1.0,
            "choice_p99_ms": round(sorted(cluster.choice_s)[int(len(cluster.choice_s) * 0.99)] * 1000, 3)
            if cluster.choice_s else None}
