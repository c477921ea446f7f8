"""Soak: many clients against one server for a long while, with the mistakes real clients make.

Starts `spanserve serve` (--model, default the embedded SmolLM2) and runs --clients concurrent
clients for --minutes. Each client loops over a seeded mix: completions, chat, chat over span
documents drawn from a small shared pool (spans reused in new orders), streamed completions it
drops after two chunks, non-streamed requests it abandons after a short timeout, and span
queries. It records every request (kind, status, latency) and samples the server's RSS and KV
blocks in use every --sample-s seconds. At the end it waits for the server to go idle and checks
that the KV blocks in use are back to the baseline taken before the first request.

Reports, per kind: requests, statuses, errors (5xx, or a broken connection the client did not
cause), p50/p99 latency; and RSS at the start, peak and end. JSON in benchmarks/results/soak.json
and a plot (RSS and blocks over time) beside it.

With --session-clients N the server gets two tenants (API keys), and the run has two phases of
--minutes each: the clients above as one tenant alone, then the same clients beside N clients of
a second tenant that each keep a session near its limits (retention close to the model's length,
flash questions, data appended as fast as its backlog takes it, questions between). The report
gives the first tenant's p50/p99 per kind in both phases and their ratio: what a session-heavy
neighbour costs a stateless tenant.

    spanserve bench soak [--clients 64] [--minutes 10] [--model M] [--session-clients 8]
"""

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.serve import make_prompt, percentile
from benchmarks.server_process import ServerProcess, metrics

KINDS = ("completion", "chat", "chat_spans", "stream_dropped", "abandoned", "span_query")
SESSION_KINDS = ("session_append", "session_query")
ABANDON_AFTER_S = 0.3
KEYS = {"stateless": "soak-key-stateless", "sessions": "soak-key-sessions"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded SmolLM2)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS / KV samples")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serve-args", default="", help="extra `spanserve serve` arguments, space separated")
    parser.add_argument("--session-clients", type=int, default=0,
                        help="a second tenant's clients, each running a session near its limits (then the run has "
                             "a phase without them and one with them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/soak.json)")
    parser.add_argument("--no-chart", action="store_true")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _docs(rng: random.Random) -> list[str]:
    return [make_prompt(rng, 120) for _ in range(8)]


async def _one(http: httpx.AsyncClient, kind: str, rng: random.Random, docs: list[str], max_tokens: int) -> int:
    """Send one request of `kind`; returns its HTTP status (0: the client gave up on purpose)."""
    if kind == "completion":
        body = {"prompt": make_prompt(rng, rng.choice([16, 64, 256])), "max_tokens": max_tokens}
        return (await http.post("/v1/completions", json=body)).status_code
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": make_prompt(rng, 48)}], "max_tokens": max_tokens}
        return (await http.post("/v1/chat/completions", json=body)).status_code
    if kind == "chat_spans":
        chosen = rng.sample(docs, 3)
        content = [{"type": "text", "text": d, "span": True} for d in chosen] + [
            {"type": "text", "text": "Which document mentions a river?"}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        return (await http.post("/v1/chat/completions", json=body)).status_code
    if kind == "stream_dropped":
        body = {"prompt": make_prompt(rng, 32), "max_tokens": 4 * max_tokens, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
            return r.status_code
    if kind == "abandoned":
        # long enough to outlast the client's patience on a fast machine (else it ends as a 200)
        body = {"prompt": make_prompt(rng, 64), "max_tokens": 16 * max_tokens, "ignore_eos": True}
        try:
            return (await http.post("/v1/completions", json=body, timeout=ABANDON_AFTER_S)).status_code
        except httpx.ReadTimeout:
            return 0
    query = {"g": {"input": {"cross": [{"system": "Be brief."}, {"plus": [
        {"g": {"input": {"user": f"Name a {w}."}, "max_tokens": 8}} for w in rng.sample(["river", "tree", "city",
                                                                                          "bird"], 2)]},
        {"user": "Which is best?"}]}, "max_tokens": max_tokens}}
    return (await http.post("/v1/spans", json={"query": query})).status_code


async def _client(url: str, index: int, deadline: float, seed: int, docs: list[str], max_tokens: int,
                  records: list, headers: dict | None = None) -> None:
    rng = random.Random(seed * 1000 + index)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as http:
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            start = time.monotonic()
            try:
                status, error = await _one(http, kind, rng, docs, max_tokens), None
            except httpx.HTTPError as exc:  # a broken connection the client did not ask for
                status, error = -1, type(exc).__name__
            records.append({"kind": kind, "status": status, "error": error, "start": start,
                            "latency_s": time.monotonic() - start})


async def _session_client(url: str, index: int, deadline: float, seed: int, records: list) -> None:
    """A tenant's session kept near its limits: retention close to the model's length, two flash
    questions, data appended as fast as the backlog takes it, a question after every few appends."""
    rng = random.Random(seed * 7919 + index)
    headers = {"Authorization": f"Bearer {KEYS['sessions']}"}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as http:
        max_len = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
        created = await http.post("/v1/sessions", json={
            "system": "Answer from the log.", "retention_tokens": max_len - 64,
            "flash": ["What is the last value?", "Which sensor is last?"], "flash_max_tokens": 16})
        records.append({"kind": "session_append", "status": created.status_code, "error": None,
                        "start": time.monotonic(), "latency_s": 0.0})
        if created.status_code != 200:
            return
        sid, appended = created.json()["id"], 0
        try:
            while time.monotonic() < deadline:
                rows = "".join(f"t={appended + i}, sensor={rng.choice('ABC')}, value={rng.randrange(100)}\n"
                               for i in range(rng.choice([4, 16, 64])))
                kind, path, body = "session_append", f"/v1/sessions/{sid}/data", {"text": rows}
                if appended % 5 == 4:
                    kind, path, body = "session_query", f"/v1/sessions/{sid}/query", {
                        "question": "Which sensor reported the highest value?", "max_tokens": 16}
                start = time.monotonic()
                try:
                    status, error = (await http.post(path, json=body)).status_code, None
                except httpx.HTTPError as exc:
                    status, error = -1, type(exc).__name__
                records.append({"kind": kind, "status": status, "error": error, "start": start,
                                "latency_s": time.monotonic() - start})
                appended += 1
                if status in (400, 429):  # its backlog is full or the queue: wait for it to drain
                    await asyncio.sleep(0.2)
        finally:
            await http.delete(f"/v1/sessions/{sid}")


async def _sampler(server: ServerProcess, deadline: float, every: float, samples: list, t0: float) -> None:
    while time.monotonic() < deadline:
        blocks = (await asyncio.to_thread(metrics, server.url))["spanserve_kv_blocks_used"]
        samples.append({"t": time.monotonic() - t0, "rss_mb": _rss_mb(server.proc.pid), "kv_blocks_used": blocks})
        await asyncio.sleep(every)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out) if args.out else harness.result_path("soak")
    model = ["--model", args.model] if args.model else []
    keys = []
    if args.session_clients:
        keys_file = out.with_suffix(".keys")
        keys_file.parent.mkdir(parents=True, exist_ok=True)
        keys_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
        keys = ["--api-keys", str(keys_file), "--metrics-public"]
    server = ServerProcess([*model, *keys, *args.serve_args.split()], out.with_suffix(".server.log"),
                           startup_timeout=300)
    try:
        baseline = metrics(server.url)["spanserve_kv_blocks_used"]
        samples, t0 = [], time.monotonic()
        docs = _docs(random.Random(args.seed))
        phases = {"alone": 0, "with_sessions": args.session_clients} if args.session_clients else {"all": 0}
        records = {}
        for phase, session_clients in phases.items():
            records[phase] = _phase(server, args, docs, session_clients, samples, t0)
        idle_at, end_blocks = _wait_idle(server, baseline)
        last = records[list(phases)[-1]]
        result = {"benchmark": "soak", "clients": args.clients, "minutes": args.minutes,
                  "session_clients": args.session_clients,
                  "machine": harness.machine_info(), "kv_blocks_baseline": baseline, "kv_blocks_end": end_blocks,
                  "kv_blocks_back_to_baseline": end_blocks == baseline, "seconds_to_idle": idle_at,
                  "rss_mb": {"start": samples[0]["rss_mb"] if samples else None,
                             "peak": max(s["rss_mb"] for s in samples) if samples else None,
                             "end": _rss_mb(server.proc.pid)},
                  "per_kind": summarize(last), "samples": samples, "requests": last}
        if args.session_clients:
            result["phases"] = {phase: summarize(rows, KINDS + SESSION_KINDS) for phase, rows in records.items()}
            result["p99_with_sessions_over_alone"] = {
                kind: _ratio(result["phases"]["with_sessions"][kind]["p99_s"], result["phases"]["alone"][kind]["p99_s"])
                for kind in KINDS}
    finally:
        server.stop()
    _report(result)
    harness.write_json(result, path=out)
    if not args.no_chart:
        _chart(result, out.with_suffix(".png"))
    return result


def _phase(server: ServerProcess, args, docs: list[str], session_clients: int, samples: list, t0: float) -> list:
    """--minutes of the stateless clients, beside `session_clients` session clients of another tenant."""
    records: list = []
    deadline = time.monotonic() + args.minutes * 60
    headers = {"Authorization": f"Bearer {KEYS['stateless']}"} if args.session_clients else None

    async def main():
        await asyncio.gather(_sampler(server, deadline, args.sample_s, samples, t0),
                             *(_client(server.url, i, deadline, args.seed, docs, args.max_tokens, records, headers)
                               for i in range(args.clients)),
                             *(_session_client(server.url, i, deadline, args.seed, records)
                               for i in range(session_clients)))

    asyncio.run(main())
    return records


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _wait_idle(server: ServerProcess, baseline: float, timeout: float = 120) -> tuple[float | None, float]:
    start = time.monotonic()
    while True:
        samples = metrics(server.url)
        idle = samples["spanserve_kv_blocks_used"] == baseline and samples["spanserve_num_requests_running"] == 0
        if idle or time.monotonic() - start > timeout:
            return (time.monotonic() - start if idle else None), samples["spanserve_kv_blocks_used"]
        time.sleep(0.5)


def summarize(records: list[dict], kinds: tuple[str, ...] = KINDS) -> dict:
    out = {}
    for kind in kinds:
        rows = [r for r in records if r["kind"] == kind]
        statuses: dict[str, int] = {}
        for r in rows:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        latencies = [r["latency_s"] for r in rows if r["status"] not in (0, -1)]
        out[kind] = {"requests": len(rows), "statuses": statuses,
                     "errors": sum(1 for r in rows if r["status"] == -1 or r["status"] >= 500),
                     "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99)}
    return out


def _report(result: dict) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [[kind, s["requests"], " ".join(f"{k}:{v}" for k, v in sorted(s["statuses"].items())), s["errors"],
             fmt(s["p50_s"]), fmt(s["p99_s"])] for kind, s in result["per_kind"].items()]
    harness.print_table(["kind", "requests", "statuses", "errors", "p50 s", "p99 s"], rows,
                        title=f"soak: {result['clients']} clients, {result['minutes']} min")
    for phase, kinds in result.get("phases", {}).items():
        harness.print_table(["kind", "requests", "statuses", "errors", "p50 s", "p99 s"],
                            [[kind, s["requests"], " ".join(f"{k}:{v}" for k, v in sorted(s["statuses"].items())),
                              s["errors"], fmt(s["p50_s"]), fmt(s["p99_s"])] for kind, s in kinds.items()],
                            title=f"phase {phase}")
    if "p99_with_sessions_over_alone" in result:
        print("stateless tenant's p99 beside the session tenant, over alone: " + ", ".join(
            f"{kind} {fmt(v)}x" for kind, v in result["p99_with_sessions_over_alone"].items()))
    rss = result["rss_mb"]
    print(f"RSS MB: start {fmt(rss['start'])}, peak {fmt(rss['peak'])}, end {fmt(rss['end'])}; KV blocks in use: "
          f"baseline {result['kv_blocks_baseline']:.0f}, end {result['kv_blocks_end']:.0f} "
          f"({'back to baseline' if result['kv_blocks_back_to_baseline'] else 'NOT back to baseline'})")


def _chart(result: dict, path: Path) -> None:
    plt = harness.pyplot()
    if plt is None:
        return
    t = [s["t"] / 60 for s in result["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(t, [s["rss_mb"] for s in result["samples"]])
    top.set_ylabel("server RSS (MB)")
    bottom.plot(t, [s["kv_blocks_used"] for s in result["samples"]])
    bottom.set_ylabel("KV blocks in use")
    bottom.set_xlabel("minutes")
    top.set_title(f"soak: {result['clients']} clients")
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("soak", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
