"""Serving benchmark: concurrent streaming clients against any OpenAI-compatible server.

--concurrency clients send --num-requests streamed requests in all to --url: a seeded mix of English
prompts of several lengths (--prompt-lens, in approximate tokens), each asking for exactly --max-tokens
tokens (temperature 0, ignore_eos). Per request it records the time to the first content token (TTFT),
the gaps between content chunks (ITL), the end-to-end latency, and the token counts of the usage chunk.
The same arguments against two servers give comparable runs; --report puts their JSONs side by side.

    spanserve bench serve --url http://127.0.0.1:8000/v1 --label spanserve
    spanserve bench serve --report benchmarks/results/serve-spanserve.json benchmarks/results/serve-vllm.json
"""

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from benchmarks import harness, server_steps

SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp.",
    "Rainfall in the valley has been unusually heavy this spring, and the river is close to flooding.",
    "Most modern processors can execute several instructions at once if they do not depend on each other.",
    "She packed a thermos of tea, two sandwiches and a paperback novel for the long train journey north.",
    "The committee will review the budget proposal on Thursday and publish its recommendations next month.",
    "Honeybees communicate the direction of a food source through a figure-eight dance inside the hive.",
    "A good recipe for bread needs only flour, water, salt, yeast and a great deal of patience.",
    "The museum's new wing displays pottery, tools and jewellery found at a Bronze Age settlement.",
    "When the market opened, shares of the shipping company fell by almost twelve percent.",
    "Children in the village learn to swim in the lake before they learn to ride a bicycle.",
    "The software update fixes a memory leak that appeared when large files were uploaded.",
    "Astronomers measured the distance to the galaxy by observing a particular kind of exploding star.",
    "Our neighbours planted tomatoes, beans and sunflowers along the fence behind their garden.",
    "The orchestra rehearsed the second movement three times before the conductor was satisfied.",
    "Glaciers carve deep valleys as they slowly move downhill under their own enormous weight.",
    "He wrote a long letter to his grandmother describing the city, the food and his new friends.",
    "The bridge was closed for repairs after inspectors found cracks in two of its supporting piers.",
    "Many early maps exaggerated the size of Europe and left large parts of the world blank.",
    "Fresh snow reflects most of the sunlight that falls on it, which keeps the ground beneath cold.",
    "The library extended its opening hours during the exam period to give students a quiet place to work.",
    "A small bakery on the corner sells warm croissants to commuters before seven in the morning.",
    "Engineers tested the new engine for hundreds of hours before approving it for passenger flights.",
    "The forest trail winds past a waterfall, an abandoned mill and a meadow full of wildflowers.",
    "Historians still debate why the ancient city was abandoned so suddenly around the year 900.",
    "The cat slept on the windowsill all afternoon, waking only when a bird landed on the ledge.",
    "Solar panels on the school roof now supply about a third of the building's electricity.",
    "The detective noticed that the clock on the mantelpiece had stopped at a quarter past eleven.",
    "Volunteers cleaned the beach on Saturday and collected more than two hundred bags of rubbish.",
    "Learning a second language changes the way people notice the sounds of their first one.",
    "The ferry crossing was rough, and most passengers stayed inside drinking coffee until the harbour appeared.",
]
WORDS = " ".join(SENTENCES).split()
CHARS_PER_TOKEN = 3.9  # this English text with the SmolLM2 tokenizer: about 3.9 characters a token


# ---- workload ---------------------------------------------------------------------------------


def make_prompt(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of running text from a random word of the sentence list, so that prompts
    rarely share a prefix beyond the chat template (a shared one would be a prefix-cache hit)."""
    start, chars, out = rng.randrange(len(WORDS)), 0, []
    while chars < tokens * CHARS_PER_TOKEN:
        word = WORDS[(start + len(out)) % len(WORDS)]
        out.append(word)
        chars += len(word) + 1
    return " ".join(out)


def make_workload(lens: list[int], n: int, seed: int) -> list[tuple[int, str]]:
    """n (target length, prompt) pairs: every length equally often, in a seeded random order."""
    rng = random.Random(seed)
    targets = (lens * (n // len(lens) + 1))[:n]
    rng.shuffle(targets)
    return [(t, make_prompt(rng, t)) for t in targets]


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


# ---- client -----------------------------------------------------------------------------------


def _content(chunk: dict) -> bool:
    """Does a stream chunk carry generated text (chat `delta.content` or completions `text`)?"""
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices") or [])


async def send(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """One streamed request, timed from just before sending to each content chunk's arrival."""
    rec = {"ok": False, "error": None, "ttft_s": None, "itl_s": [], "e2e_s": None, "chunks": 0,
           "prompt_tokens": None, "output_tokens": None, "cached_tokens": None}
    start = last = time.perf_counter()
    usage, done = None, False
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                done = done or line.strip() == "data: [DONE]"
                if not line.startswith("data:") or done:
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    rec["error"] = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return rec
                usage = chunk.get("usage") or usage
                if _content(chunk):
                    now = time.perf_counter()
                    if rec["chunks"] == 0:
                        rec["ttft_s"] = now - start
                    else:
                        rec["itl_s"].append(now - last)
                    last, rec["chunks"] = now, rec["chunks"] + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    rec["e2e_s"] = time.perf_counter() - start
    if usage:
        rec["prompt_tokens"], rec["output_tokens"] = usage.get("prompt_tokens"), usage.get("completion_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:  # a server that ignores include_usage: count the chunks (a chunk may hold several tokens)
        rec["output_tokens"] = rec["chunks"]
    rec["error"] = None if done and rec["chunks"] else "stream ended early" if not done else "no content in stream"
    rec["ok"] = rec["error"] is None
    return rec


async def run_clients(client: httpx.AsyncClient, path: str, bodies: list[dict], concurrency: int) -> list[dict]:
    """`concurrency` clients, each sending its next request as soon as its previous one ends."""
    records: list[dict | None] = [None] * len(bodies)
    todo = iter(range(len(bodies)))  # shared by the clients (one event loop: no locking needed)

    async def worker() -> None:
        for i in todo:
            records[i] = await send(client, path, bodies[i])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def served_model(url: str, headers: dict) -> str:
    r = httpx.get(f"{url}/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# ---- statistics -------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: list[dict], duration_s: float) -> dict:
    """Aggregate metrics over the successful requests; rates are over the wall time of the whole run."""
    ok = [r for r in records if r["ok"]]
    ms = lambda values, p: None if (v := percentile(values, p)) is None else v * 1000  # noqa: E731
    ttft = [r["ttft_s"] for r in ok]
    itl = [gap for r in ok for gap in r["itl_s"]]
    # time per output token after the first: robust to servers that pack several tokens in a chunk
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok if (r["output_tokens"] or 0) > 1]
    e2e = [r["e2e_s"] for r in ok]
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    output_tokens = sum(r["output_tokens"] or 0 for r in ok)
    # None, not 0, when the server never reports them (vLLM does only with --enable-prompt-tokens-details)
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s, "output_tok_s": output_tokens / duration_s,
        "total_tok_s": (prompt_tokens + output_tokens) / duration_s,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
        "tpot_p50_ms": ms(tpot, 50), "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
    }


# (summary key, row name, which way is better)
METRICS = [
    ("requests_per_s", "requests/s", "higher"),
    ("output_tok_s", "output tok/s", "higher"),
    ("total_tok_s", "total tok/s", "higher"),
    ("ttft_p50_ms", "TTFT p50 ms", "lower"),
    ("ttft_p99_ms", "TTFT p99 ms", "lower"),
    ("itl_p50_ms", "ITL p50 ms", "lower"),
    ("itl_p99_ms", "ITL p99 ms", "lower"),
    ("tpot_p50_ms", "TPOT p50 ms", "lower"),
    ("e2e_p50_ms", "E2E p50 ms", "lower"),
    ("e2e_p99_ms", "E2E p99 ms", "lower"),
    ("completed", "completed", "higher"),
    ("errors", "errors", "lower"),
    ("prompt_tokens", "prompt tokens", None),
    ("output_tokens", "output tokens", None),
    ("cached_tokens", "cached tokens", None),
]


def report(paths: list[str]) -> list[dict]:
    """Print several result JSONs side by side; ratios are first / each other (the first is ours)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    names = [f"{r['label']}#{i + 1}" if [x["label"] for x in runs].count(r["label"]) > 1 else r["label"]
             for i, r in enumerate(runs)]
    headers = ["metric", *names, *(f"{names[0]}/{n}" for n in names[1:]), "better"]
    rows = []
    for key, name, better in METRICS:
        values = [r["summary"].get(key) for r in runs]
        ratios = [f"{values[0] / v:.2f}x" if values[0] is not None and v else None for v in values[1:]]
        rows.append([name, *values, *ratios, better])
    harness.print_table(headers, rows, title="serving benchmark (ratios: first / other)")
    for n, r in zip(names, runs):
        a = r["args"]
        print(f"  {n}: {r['url']} ({Path(r['model']).name}), {a['num_requests']} requests, "
              f"concurrency {a['concurrency']}, prompts {a['prompt_lens']}, "
              f"max_tokens {a['max_tokens']}, {a['endpoint']}, load average before "
              f"{' '.join(f'{x:.2f}' for x in r['loadavg_before'])}")
    return runs


# ---- CLI --------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="served model name (default: the first of GET /models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--num-requests", type=int, default=64, help="requests in all")
    parser.add_argument("--prompt-lens", default="32,256,1024", help="prompt lengths in approximate tokens")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests before the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--label", default=None, help="name of this run (default: the URL's host-port)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve-LABEL.json)")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print result JSONs side by side and exit")


async def _measure(args, model: str, headers: dict) -> tuple[list[dict], float, dict | None]:
    lens = [int(x) for x in args.prompt_lens.split(",")]
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    bodies = [request_body(args.endpoint, model, p, args.max_tokens)
              for _, p in make_workload(lens, args.num_requests, args.seed)]
    warmup = [request_body(args.endpoint, model, p, 8) for _, p in make_workload(lens, args.warmup, args.seed + 1)]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        for rec in [await send(client, path, b) for b in warmup]:
            if not rec["ok"]:
                sys.exit(f"warm-up request failed: {rec['error']}")
        metrics = server_steps.metrics_url(args.url)
        steps_before = await server_steps.read(client, metrics)
        start = time.perf_counter()
        records = await run_clients(client, path, bodies, args.concurrency)
        duration = time.perf_counter() - start
        steps = server_steps.summarize(steps_before, await server_steps.read(client, metrics), duration)
        return records, duration, steps


def run(args: argparse.Namespace) -> dict:
    if args.report:
        return {"runs": report(args.report)}
    args.url = url = args.url.rstrip("/")
    label = args.label or f"{urlparse(url).hostname}-{urlparse(url).port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or served_model(url, headers)
    loadavg_before = list(os.getloadavg())
    print(f"{label}: {args.num_requests} requests, {args.concurrency} clients, {url} ({model}), "
          f"load average {loadavg_before[0]:.2f}", file=sys.stderr, flush=True)
    records, duration, steps = asyncio.run(_measure(args, model, headers))
    summary = summarize(records, duration)
    rows = [[name, summary[key]] for key, name, _ in METRICS]
    harness.print_table(["metric", label], rows, title=f"serving benchmark: {url} ({model})")
    if steps:
        harness.print_table(["server engine", label], server_steps.rows(steps),
                            title=f"its engine during the run ({server_steps.metrics_url(url)})")
    else:
        print(f"  no engine step counters at {server_steps.metrics_url(url)} (not a spanserve server, or no access)")
    for err in dict.fromkeys(r["error"] for r in records if r["error"]):
        print(f"  error: {err}")
    data = {
        "benchmark": "serve", "label": label, "url": url, "model": model,
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key", "report")},
        "loadavg_before": loadavg_before, "loadavg_after": list(os.getloadavg()),
        "machine": harness.machine_info(),  # after the run: it imports torch, which the client does not need
        "summary": summary, "server_steps": steps, "requests": records,
    }
    harness.write_json(data, path=args.out or harness.result_path(f"serve-{label}"))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spanserve bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.url and not args.report:
        parser.error("give --url (or --report JSON...)")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
