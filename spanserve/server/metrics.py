"""Prometheus metrics in the text exposition format (no client library needed)."""

import bisect
from collections import defaultdict

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=_LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {cumulative}"]


class ServerMetrics:
    def __init__(self):
        self.requests = defaultdict(int)  # by final status: ok, error, abort
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram()
        self.inter_token = Histogram()
        self.e2e = Histogram()

    def render(self, engine) -> str:
        kv, sched = engine.kv, engine.scheduler
        hit_rate = kv.hit_tokens / kv.queried_tokens if kv.queried_tokens else 0.0
        span_hit_rate = kv.span_hit_tokens / kv.span_queried_tokens if kv.span_queried_tokens else 0.0
        lines = ["# TYPE spanserve_requests_total counter"]
        lines += [f'spanserve_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
        gauges = {
            "spanserve_prompt_tokens_total": self.prompt_tokens,
            "spanserve_generation_tokens_total": self.generation_tokens,
            "spanserve_cached_prompt_tokens_total": self.cached_tokens,
            "spanserve_num_requests_running": len(sched.running),
            "spanserve_num_requests_waiting": len(sched.waiting),
            "spanserve_kv_blocks_used": kv.pool.num_blocks - kv.pool.num_free,
            "spanserve_kv_blocks_free": kv.pool.num_free,
            "spanserve_kv_cache_usage": round(kv.usage, 6),
            "spanserve_prefix_cache_hit_rate": round(hit_rate, 6),
            "spanserve_span_tokens_total": kv.span_queried_tokens,  # prompt tokens inside spans
            "spanserve_span_hit_tokens_total": kv.span_hit_tokens,  # ... whose KV was reused
            "spanserve_span_hit_rate": round(span_hit_rate, 6),
            "spanserve_num_preemptions_total": sched.num_preemptions,
            "spanserve_background_steps_stopped_total": sched.background.num_stopped,  # ingest chunks redone
        }
        for name, value in gauges.items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        for name, hist in (("spanserve_time_to_first_token_seconds", self.ttft),
                           ("spanserve_inter_token_latency_seconds", self.inter_token),
                           ("spanserve_e2e_request_latency_seconds", self.e2e)):
            lines += [f"# TYPE {name} histogram", *hist.lines(name)]
        return "\n".join(lines) + "\n"
