"""Routing across replicas: one trace of reordered-document RAG requests and multi-turn chats from
several tenants (cluster_trace.py), replayed against four routers: round-robin, pow2 (Ray
Serve's default, power of two choices), prefix (Ray's PrefixCacheAffinityRouter, the one
`ray.serve.llm` uses) and span (ours).

Two runs:
- **real**: `spanserve serve --replicas R --router NAME` on this machine (R=2 by default, the
  default model), one fresh cluster per router. Each tenant's documents are sent once (in groups
  of k) to warm the caches, then the trace is replayed by 2 clients (max_tokens 1: the latency is
  the time to the first token). Per router: prompt tokens computed (prompt less cached, from each
  answer's usage), the share of span tokens whose KV was reused (spanserve_span_hit_tokens over
  spanserve_span_tokens in the cluster's /metrics, over the replay), TTFT p50/p99, requests per
  replica (max/mean), and the span router's own time (keys and choice, p99 from /metrics).
- **sim**: the same kind of trace, longer, through a model of 16-256 replicas with the same
  routing code (cluster_sim.py: each replica's LRU cache of block keys and a queue). Prefill tokens
  computed and hit rates are exact for the model; times are the model's.

    spanserve bench cluster [--skip-real] [--sim-replicas 16,64,256] [--routers ...]
"""

import argparse
import logging
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness
from benchmarks.cluster_sim import ROUTERS, SimConfig, simulate
from benchmarks.cluster_trace import Call, SimRenderer, http_body, make_trace
from benchmarks.server_process import free_port

MODEL_NAME = "model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routers", default=",".join(ROUTERS), help="routers to compare, comma-separated")
    parser.add_argument("--skip-real", action="store_true", help="only the simulation")
    parser.add_argument("--skip-sim", action="store_true", help="only the real replicas")
    parser.add_argument("--replicas", type=int, default=2, help="real replicas (they share this machine's CPUs)")
    parser.add_argument("--model", default=None, help="real run: HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--num-blocks", type=int, default=448, help="real run: KV blocks per replica (the "
                        "default holds about three quarters of the tenants' documents)")
    parser.add_argument("--calls", type=int, default=200, help="real run: calls replayed after the warm-up")
    parser.add_argument("--docs", type=int, default=16, help="real run: documents in the shared corpus")
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--k", type=int, default=3, help="documents per RAG request")
    parser.add_argument("--sim-replicas", default="16,64,256", help="simulated cluster sizes, comma-separated")
    parser.add_argument("--sim-calls", type=int, default=12000, help="simulated calls at 64 replicas (scaled "
                        "with the cluster's size, at least this many)")
    parser.add_argument("--sim-docs", type=int, default=256, help="simulation: documents in the shared corpus")
    parser.add_argument("--sim-tenants", type=int, default=4)
    parser.add_argument("--sim-capacity", type=int, default=4096, help="simulation: KV blocks a replica caches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/cluster.json)")


def run(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    routers = args.routers.split(",")
    data = {"machine": harness.machine_info(), "args": vars(args), "real": [], "sim": []}
    if not args.skip_real:
        data["real"] = real_runs(args, routers)
        harness.print_table(
            ["router", "prompt tok", "computed", "span hit", "TTFT p50 ms", "TTFT p99 ms", "req max/mean",
             "keys p99 ms", "added p99 ms", "choice p99 ms"],
            [[r["router"], r.get("prompt_tokens"), r.get("prefill_tokens"), r.get("span_hit_rate"),
              r.get("ttft_p50_ms"), r.get("ttft_p99_ms"), r.get("request_skew"), r["keys_p99_ms"],
              r.get("added_p99_ms"), r.get("choice_p99_ms")] for r in data["real"]],
            title=f"{args.replicas} real replicas, {args.calls} calls after warm-up")
    if not args.skip_sim:
        data["sim"] = sim_runs(args, routers)
        harness.print_table(
            ["replicas", "router", "computed", "vs prefix", "hit rate", "TTFT p50 s", "TTFT p99 s", "load skew",
             "choice p99 ms"],
            [[r["replicas"], r["router"], r["prefill_tokens"], r.get("vs_prefix"), r["hit_rate"], r["ttft_p50_s"],
              r["ttft_p99_s"], r["load_skew"], r["choice_p99_ms"]] for r in data["sim"]],
            title="simulated replicas")
    harness.write_json(data, name="cluster", path=args.out)
    return data


def sim_runs(args, routers: list[str]) -> list[dict]:
    rows = []
    renderer = SimRenderer()
    for n in [int(x) for x in args.sim_replicas.split(",")]:
        calls = max(args.sim_calls, args.sim_calls * n // 64)
        trace = make_trace(calls, docs=args.sim_docs, k=4, tenants=args.sim_tenants, conversations=4, turns=6,
                           chat_share=0.15, seed=args.seed)
        requests = [renderer.request(c) for c in trace]
        point = {}
        for router in routers:
            began = time.perf_counter()
            point[router] = simulate(requests, SimConfig(replicas=n, capacity=args.sim_capacity, seed=args.seed),
                                     router)
            print(f"sim {n} replicas, {router}: {point[router]} ({time.perf_counter() - began:.0f} s)", flush=True)
        for row in point.values():
            if "prefix" in point:
                row["vs_prefix"] = round(row["prefill_tokens"] / point["prefix"]["prefill_tokens"], 3)
            rows.append(row)
    return rows


def real_runs(args, routers: list[str]) -> list[dict]:
    import ray

    from spanserve.cluster import launch
    from spanserve.cluster.replica import ServerOptions
    from spanserve.config import EngineConfig
    from spanserve.corpus import paragraphs

    texts = paragraphs("eval")
    documents = [" ".join(texts[3 * i:3 * i + 3]) for i in range(args.docs)]  # a few hundred tokens each
    keys = {t: f"key-tenant-{t}" for t in range(args.tenants)}
    warm = [c for t in range(args.tenants) for c in _warm_up(t, args.docs, args.k)]
    trace = make_trace(args.calls, docs=args.docs, k=args.k, tenants=args.tenants, conversations=2, turns=4,
                       chat_share=0.15, seed=args.seed)
    rows = [_keys_cost(args, documents, warm + trace)]
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.txt"
        keys_file.write_text("".join(f"{key} tenant-{t}\n" for t, key in keys.items()))
        for router in routers:
            config = EngineConfig(model=args.model, num_blocks=args.num_blocks)
            options = ServerOptions(MODEL_NAME, api_keys=str(keys_file), router=router)
            began = time.monotonic()
            url = launch.start(config, options, args.replicas, port=free_port(),
                               replica_cpus=len(os.sched_getaffinity(0)) / args.replicas)
            print(f"{router}: cluster up in {time.monotonic() - began:.0f} s", flush=True)
            try:
                rows.append(_replay(url, router, documents, keys, warm, trace))
            finally:
                launch.stop()
                ray.shutdown()
    return rows


def _keys_cost(args, documents: list[str], calls: list[Call]) -> dict:
    """The ingress's work for the span router, on its own on an idle machine: tokenizing and hashing
    each call's body into keys (in a cluster it shares the CPUs with the replicas). `added`: that
    work less tokenizing the spans, which the replica is then spared (it takes the ingress's ids)."""
    import json

    from spanserve.cluster.keys import HashContext, RequestKeys
    from spanserve.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model, False))
    hasher = RequestKeys(tokenizer, HashContext(16, 0, None, (), True))
    spans_s = [0.0]

    def timed_encode(text, **kwargs):
        began = time.perf_counter()
        ids = tokenizer.encode(text, **kwargs)
        spans_s[0] += time.perf_counter() - began
        return ids

    hasher.span_tokens.tokenizer = SimpleNamespace(encode=timed_encode)
    times, added = [], []
    for call in calls * 3:
        path, body = http_body(call, documents, MODEL_NAME)
        raw = json.dumps(body).encode()
        spans_s[0], began = 0.0, time.perf_counter()
        hasher(path, raw, lambda salt, tenant=call.tenant: f"tenant-{tenant}")
        times.append(time.perf_counter() - began)
        added.append(times[-1] - spans_s[0])
    return {"router": "keys alone", "keys_p50_ms": _ms(times, 0.5), "keys_p99_ms": _ms(times, 0.99),
            "added_p50_ms": _ms(added, 0.5), "added_p99_ms": _ms(added, 0.99)}


def _ms(seconds: list[float], q: float) -> float:
    return round(sorted(seconds)[int(len(seconds) * q)] * 1000, 3)


def _warm_up(tenant: int, docs: int, k: int) -> list[Call]:
    """Each of a tenant's documents once, in groups of k."""
    return [Call(tenant, docs=tuple(range(i, min(i + k, docs))), question=-1 - i) for i in range(0, docs, k)]


def _replay(url: str, router: str, documents: list[str], keys: dict, warm: list, trace: list) -> dict:
    import httpx

    def send(call) -> dict:
        path, body = http_body(call, documents, MODEL_NAME)
        began = time.perf_counter()
        r = httpx.post(url + path, json=body, timeout=300, headers={"Authorization": f"Bearer {keys[call.tenant]}"})
        if r.status_code != 200:
            raise RuntimeError(f"{router}: {r.status_code} {r.text[:300]}")
        usage = r.json()["usage"]
        return {"ms": (time.perf_counter() - began) * 1000, "prompt": usage["prompt_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"], "replica": r.headers["x-spanserve-replica"],
                "rag": call.conversation is None}

    auth = {"Authorization": f"Bearer {keys[0]}"}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(send, warm))
        time.sleep(1.0)  # the replicas publish what they hold
        before = _span_counters(httpx.get(url + "/metrics", headers=auth, timeout=60).text)
        results = list(pool.map(send, trace))
    metrics_text = httpx.get(url + "/metrics", headers=auth, timeout=60).text
    after = _span_counters(metrics_text)
    span_tokens, span_hits = after[0] - before[0], after[1] - before[1]
    per_replica = {}
    for r in results:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    ms = sorted(r["ms"] for r in results)
    return {"router": router, "calls": len(results), "prompt_tokens": sum(r["prompt"] for r in results),
            "prefill_tokens": sum(r["prompt"] - r["cached"] for r in results),
            "span_hit_rate": round(span_hits / span_tokens, 4) if span_tokens else None,
            "ttft_p50_ms": round(statistics.median(ms), 1), "ttft_p99_ms": round(ms[int(len(ms) * 0.99)], 1),
            "requests_per_replica": per_replica,
            "request_skew": round(max(per_replica.values()) / (len(results) / len(per_replica)), 3),
            "keys_p99_ms": _p99_ms(metrics_text, "spanserve_routing_keys_seconds"),
            "choice_p99_ms": _p99_ms(metrics_text, "spanserve_routing_choice_seconds")}


def _span_counters(text: str) -> tuple[float, float]:
    """Span tokens and span tokens reused, summed over the replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"spanserve_span_tokens": 0.0, "spanserve_span_hit_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["spanserve_span_tokens"], totals["spanserve_span_hit_tokens"]


def _p99_ms(text: str, name: str) -> float | None:
    """The upper bound of the bucket holding a histogram's 99th percentile, in ms (None: no samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
        total = buckets[-1][1] if buckets else 0
        if not total:
            return None
        return next(round(le * 1000, 3) for le, count in buckets if count >= 0.99 * total)
    return None


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("cluster", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
