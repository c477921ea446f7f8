"""What a spanserve server's engine did during a `bench serve` run, from the step counters its
/metrics exposes (spanserve_engine_*, engine/step_times.py) read before and after the run: how much
of the run the engine was stepping, how much of a step was the model's forward pass and LM head,
and the host work around it (scheduling, inputs, sampling, detokenizing) per step. A server
without those counters (another engine) gives None."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

FIELDS = {"spanserve_engine_steps": "steps", "spanserve_engine_step_tokens": "tokens",
          "spanserve_engine_step_seconds": "seconds", "spanserve_engine_model_seconds": "model_seconds"}


def metrics_url(openai_url: str) -> str:
    """/metrics beside the OpenAI routes: http://host:port/v1 -> http://host:port/metrics."""
    base = openai_url.rstrip("/")
    return f"{base.removesuffix('/v1')}/metrics"


async def read(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, float]] | None:
    """The step counters by kind of step (summed over replicas), or None where the server has none."""
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(response.text):
        field = FIELDS.get(family.name)
        for sample in family.samples if field else ():
            if sample.name.endswith("_total"):
                kind = totals.setdefault(sample.labels["kind"], dict.fromkeys(FIELDS.values(), 0.0))
                kind[field] += sample.value
    return totals or None


def summarize(before: dict | None, after: dict | None, duration_s: float) -> dict | None:
    """The run's share of the counters: steps by kind, the engine's busy share of the run (a sum
    over replicas, so up to 100% a replica), the model's share of step time, host ms a step, and
    decode steps' mean time, model time and batch."""
    if before is None or after is None:
        return None
    delta = {kind: {f: v - before.get(kind, {}).get(f, 0.0) for f, v in fields.items()}
             for kind, fields in after.items()}
    steps = sum(d["steps"] for d in delta.values())
    seconds = sum(d["seconds"] for d in delta.values())
    model = sum(d["model_seconds"] for d in delta.values())
    decode = delta.get("decode") or {}
    decodes = decode.get("steps", 0)
    return {
        "steps": {kind: int(d["steps"]) for kind, d in delta.items()},
        "busy_pct": 100 * seconds / duration_s,
        "model_pct_of_steps": 100 * model / seconds if seconds else None,
        "host_ms_per_step": 1000 * (seconds - model) / steps if steps else None,
        "decode_step_ms": 1000 * decode["seconds"] / decodes if decodes else None,
        "decode_model_ms": 1000 * decode["model_seconds"] / decodes if decodes else None,
        "decode_batch": decode["tokens"] / decodes if decodes else None,
    }


def rows(summary: dict) -> list[list]:
    """Table rows of a summarize() result."""
    steps = ", ".join(f"{kind} {n}" for kind, n in summary["steps"].items())
    return [["engine busy % of the run", summary["busy_pct"]], ["steps", steps],
            ["model % of step time", summary["model_pct_of_steps"]],
            ["host ms a step", summary["host_ms_per_step"]], ["decode step ms", summary["decode_step_ms"]],
            ["decode step model ms", summary["decode_model_ms"]], ["decode batch", summary["decode_batch"]]]
