"""Streaming sessions: questions over a growing data feed (papers/stateful-streaming-sessions.txt).

A synthetic feed of hourly price bars (open, high, low, close, volume) grows from about a fifth of
--max-context tokens to all of it in --steps steps. At each step the new bars are appended and,
once ingested, questions are asked (greedy), the same token sequence on every path, same run:
  session           spanserve session: the data computed in the background, the question alone
  session, sparse   the same with a sparse flow (--sparse) over the data for the question and its
                    answer (sparse_prefill), its answers compared with the dense session's
  flash hit         the same questions registered on the session: the kept answer
  while ingesting   a session question arriving (another thread's request) at a random point of a
                    background chunk, timed from its arrival: the chunk stops between layers (the
                    server's engine loop); "chunk not stopped": it waits for the chunk's end
  stateless         a plain request, the prefix cache warm from the previous step: the new data
                    and the question are computed (what a server does today; one per step)
  stateless cached  a plain request after a request of the data alone: the question is computed
  llama.cpp         llama-cpp-python (same GGUF, --llama-cpp), its KV holding the previous step:
                    the new data and the question (one per step)
  llama.cpp cached  the data evaluated first, then data + question
  vLLM, vLLM cached the same two on a vLLM-CPU server with prefix caching (--vllm-url)
Latency is the time to a one-token answer (the paper's classification questions). Ingest is the
background throughput, from append to visible. The rolling-window check runs a second session
whose retention keeps half the feed: questions about the latest alerts (in its window; the feed
has one every 12 bars, with a code) must get the answers the full-context session gets, and both
are checked against the data. The speculative-exit check runs a third session whose instructions
pose the trend question and that exits at its ready position (sessions/ready.py, --exit-threshold):
at each step the trend question is asked of it; reported are whether it exited, its latency, and its
answer against the computed one (the same tokens as a plain request) and against the bars.

    spanserve bench session [--model M] [--max-context 7600] [--steps 15] [--repeats 1] [--llama-cpp]
"""

import argparse
import math
import random
import statistics
import sys
import threading
import time

from benchmarks import harness
from benchmarks.llama_cpp_peer import LlamaCppPeer, peer_gguf

QUESTIONS = ("Is the trend of the last ten bars UP or DOWN? Answer UP or DOWN.",
             "Did the last bar close above its open? Answer YES or NO.",
             "Was the last bar's volume above 20000? Answer YES or NO.")
SYSTEM = "You analyse hourly price bars of one stock. Answer briefly."
STANDING = ("You analyse hourly price bars of one stock. Reply UP if the last bar closed above the bar ten "
            "bars before it, else DOWN.")
TREND = QUESTIONS[0]  # the standing session's question
ALERT_EVERY = 12
SETTLE_S = 0.5  # a pause after the peers' requests (_settle)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--max-context", type=int, default=7600, help="data tokens at the last step")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=1,
                        help="ask each question this many times on every path (medians over all: a noisy machine); "
                             "stateless cached then reuses the question's whole blocks from the ask before")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp (needs llama-cpp-python)")
    parser.add_argument("--vllm-url", default=None, help="add a running vLLM server (prefix caching on, the "
                        "same model's HF directory; ../shared/PEERS.md), e.g. http://127.0.0.1:8011")
    parser.add_argument("--background-chunk-tokens", type=int, default=None,
                        help="the largest ingest chunk per background step (default: the engine's)")
    parser.add_argument("--window-questions", type=int, default=4, help="rolling-window questions per step")
    parser.add_argument("--exit-threshold", type=float, default=2.0,
                        help="speculative exit check: the logit lead the ready position's answer needs")
    parser.add_argument("--sparse", default=None, help="add session questions over a sparse flow's blocks "
                        "(e.g. block_topk), their answers checked against the dense ones")
    parser.add_argument("--sparse-budget", type=int, default=1024, help="tokens the sparse flow attends to")
    parser.add_argument("--quantization", default=None,
                        help="our engine's weights: int8, int4 or w8a8 (llama.cpp reads the GGUF's own blocks)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/session-<model>.json)")


def bars(count: int, seed: int = 0) -> list[str]:
    """Hourly bars with trends, pullbacks and sideways phases (the paper's OHLCV feed); every
    ALERT_EVERY bars an alert with a code, what the rolling-window check asks about."""
    rng, price, rows = random.Random(seed), 100.0, []
    for i in range(count):
        if i % ALERT_EVERY == ALERT_EVERY - 1:
            trader = f"{_TRADERS[i // ALERT_EVERY % len(_TRADERS)]} {i // ALERT_EVERY}"
            rows.append(f"ALERT: the desk code of {trader} is {rng.randrange(1000, 10000)}.\n")
            continue
        drift = 0.3 * math.sin(i / 40) + rng.uniform(-0.4, 0.4)
        open_, close = price, price + drift
        high, low = max(open_, close) + rng.uniform(0, 0.5), min(open_, close) - rng.uniform(0, 0.5)
        day, hour = divmod(i, 8)
        rows.append(f"d{day + 1:03d} {9 + hour:02d}h O {open_:.2f} H {high:.2f} L {low:.2f} C {close:.2f} "
                    f"V {rng.randrange(8000, 32000)}\n")
        price = close
    return rows


def run(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    harness.configure_threads()
    from spanserve import LLM, SamplingParams

    chunk = {"background_chunk_tokens": args.background_chunk_tokens} if args.background_chunk_tokens else {}
    llm = LLM(model=args.model, kv_cache_memory_gb=3.0, quantization=args.quantization, **chunk)
    fmt = llm.engine.sessions.format
    per_row = statistics.mean(len(fmt.data(r)) for r in bars(50, seed=1))
    total_rows = int(args.max_context / per_row)
    start_rows = total_rows // 5
    feed = bars(total_rows)
    step_rows = (total_rows - start_rows) // args.steps
    one = SamplingParams(temperature=0, max_tokens=1)
    sparse = _sparse(args, one)
    peers = [p for p in (_llama(args), _Vllm(args.vllm_url) if args.vllm_url else None) if p is not None]

    full = llm.create_session(SYSTEM, flash=list(QUESTIONS), flash_max_tokens=1)
    window = llm.create_session(SYSTEM, retention_tokens=int(args.max_context * 0.5) + 64)
    standing = llm.create_session(STANDING, exit_answers=["UP", "DOWN"], exit_threshold=args.exit_threshold)
    for session in (full, window, standing):
        session.append("".join(feed[:start_rows]))
        session.wait()
    _warm(llm, full, one)
    steps, shown, fed, rng = [], 0, start_rows, random.Random(0)
    for step in range(args.steps + 1):
        row = {"step": step, "while_ingesting_ms": None, "while_ingesting_unstopped_ms": None, "ingest_tok_s": None}
        if step:
            new = "".join(feed[fed:fed + step_rows])
            fed += step_rows
            row.update(_ingest(llm, full, new, QUESTIONS[step % len(QUESTIONS)], one, args.repeats, rng))
            for session in (window, standing):
                session.append(new)
                session.wait()
        row.update(_measure(llm, full, one, peers, step, sparse, args.repeats), rows=fed)
        row.update(_window_check(full, window, feed[:fed], args.window_questions, args))
        row.update(_exit_check(llm, standing, feed[:fed], one))
        steps.append(row)
        shown = _print_progress(steps, shown)
    result = _summary(args, steps, [p.name for p in peers])
    harness.write_json(result, path=args.out or harness.result_path(f"session-{_name(args.model)}"))
    return result


_TRADERS = ("Ada Moss", "Bram Pell", "Cleo Rowe", "Dario Sato", "Edda Voss", "Fenn Wick", "Gita Yates", "Hugo Tamm")


def _name(model) -> str:
    return (model or "smollm2").lower().replace("/", "_")


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _timed_answer(session, question: str, params) -> tuple[float, str]:
    start = time.perf_counter()
    text = session.query(question, params).text
    return time.perf_counter() - start, text


def _warm(llm, session, params) -> None:
    for q in QUESTIONS:
        session.query(_asked(q), params)


def _asked(question: str, repeat: int = 0) -> str:
    """The computed paths ask the registered questions numbered and with a trailing space: the same
    meaning in other tokens (3 more; as many for every repeat), so the session computes its answer
    rather than returning the kept one. Each repeat has its own number, at the question's start:
    a stateless request whose prompt matched an earlier one's up to its question's first block
    would find that block in the prefix cache (with the repeats told apart by trailing spaces
    alone, a repeat of stateless cached computed 12 of 28 rows) while the session
    computes every row."""
    return f"Q{repeat + 1}. {question} "


def _ingest(llm, session, text: str, question: str, params, repeats: int, rng: random.Random) -> dict:
    """Append `text` and time its ingest, from append to visible, the questions excluded. Meanwhile
    `question` arrives `repeats` times during a background chunk, at a random point of it, and is
    timed from its arrival to its answer: once with the chunk stopped between layers, as the server
    does (engine.step's `interrupt`), and once with the chunk run to its end."""
    version = session.append(text)
    start = time.perf_counter()
    chunk_s = _timed(llm.engine.step)  # an ordinary chunk: how long one takes
    busy, answering = {True: [], False: []}, 0.0
    for _ in range(repeats):
        for stops in (True, False):
            if session.version >= version:  # no chunk left to arrive during
                break
            waited, answer_s = _asked_during_chunk(llm, session, question, params, rng.random() * chunk_s, stops)
            busy[stops].append(waited)
            answering += answer_s
    while session.version < version:
        llm.engine.step()
    ingest_s = time.perf_counter() - start - answering
    session.wait()  # the flash questions, answered again
    median = lambda values: statistics.median(values) * 1000 if values else None  # noqa: E731
    return {"while_ingesting_ms": median(busy[True]), "while_ingesting_unstopped_ms": median(busy[False]),
            "ingest_tok_s": len(llm.engine.sessions.format.data(text)) / ingest_s}


def _asked_during_chunk(llm, session, question: str, params, delay: float, stops: bool) -> tuple[float, float]:
    """`question` arrives (another thread's request) `delay` seconds into the background steps:
    (seconds from its arrival to its answer, seconds to answer it once asked)."""
    arrived: list[float] = []
    timer = threading.Timer(delay, lambda: arrived.append(time.perf_counter()))
    timer.start()
    while not arrived:  # the step under way when it arrives stops, or ends, before it is asked
        llm.engine.step(interrupt=(lambda: bool(arrived)) if stops else None)
    timer.join()
    answer_s = _timed(session.query, _asked(question), params)
    return time.perf_counter() - arrived[0], answer_s


def _sparse(args, params):
    """`params` over the --sparse flow's blocks, the question included; None without --sparse."""
    from spanserve import SamplingParams

    if not args.sparse:
        return None
    return SamplingParams(**{**params.__dict__, "sparse": args.sparse, "sparse_budget": args.sparse_budget,
                             "sparse_prefill": True})


def _measure(llm, session, params, peers: list, step: int, sparse=None, repeats: int = 1) -> dict:
    """One step's latencies (ms, median over the questions) on every path, same tokens. The
    stateless paths first see this step's data in one question (a variant no other path asks),
    which computes the new data; each path then computes every question for the first time.
    With `sparse` (params), the session is asked each question that way too: its latency, and
    whether its answer is the dense session's."""
    fmt, state = llm.engine.sessions.format, session._session.state
    data = state.tokens + state.pending
    rows = {"context_tokens": len(data)}
    times: dict[str, list[float]] = {k: [] for k in ("session", "flash_hit", "stateless", "stateless_cached")}
    if sparse is not None:
        times["session_sparse"], rows["sparse_agree"] = [], 0.0
    def prompt_of(question: str) -> list[int]:  # the tokens the session's question sees
        return session._session.prompt(fmt.question(question))

    first = prompt_of(_asked(QUESTIONS[step % len(QUESTIONS)], repeats))  # a variant no repeat asks
    times["stateless"].append(_timed(llm.generate, {"prompt_token_ids": first}, params))
    for peer in peers:
        times[peer.name] = [peer.answer(first)]
        times[f"{peer.name}_cached"] = []
    _settle(peers)
    asked = [(q, r) for r in range(repeats) for q in QUESTIONS]  # each path asks them in turn
    for q, r in asked:
        prompt = prompt_of(_asked(q, r))
        llm.generate({"prompt_token_ids": data}, params)  # the data alone, then the question on it
        times["stateless_cached"].append(_timed(llm.generate, {"prompt_token_ids": prompt}, params))
        seconds, dense = _timed_answer(session, _asked(q, r), params)
        times["session"].append(seconds)
        if sparse is not None:
            seconds, answer = _timed_answer(session, _asked(q, r), sparse)
            times["session_sparse"].append(seconds)
            rows["sparse_agree"] += (answer == dense) / len(asked)
        hit = session.query(q, params)
        times["flash_hit"].append(_timed(session.query, q, params) if hit.flash_hit else math.nan)
        for peer in peers:
            peer.answer(data)
            times[f"{peer.name}_cached"].append(peer.answer(prompt))
        _settle(peers)
    for key, values in times.items():
        rows[f"{key}_ms"] = statistics.median(values) * 1000 if values else None
    return rows


def _settle(peers: list) -> None:
    """Let a peer's threads go idle before our next timing: OpenMP runtimes spin for a while after
    each parallel region (vLLM's libiomp5 200 ms by default, KMP_BLOCKTIME), on the cores we time."""
    if peers:
        time.sleep(SETTLE_S)


def _window_check(full, window, fed: list[str], count: int, args) -> dict:
    """Questions about the latest alerts (inside the window's retention): the window session against
    the full-context one and against the data; with --sparse, the full session asked sparsely too."""
    from spanserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12)
    sparse = _sparse(args, params)
    alerts = [row for row in fed if row.startswith("ALERT")][-count:]
    right = {"window": 0, "full": 0, "agree": 0, **({"full_sparse": 0, "sparse_agree": 0} if sparse else {})}
    for alert in alerts:
        trader, code = alert.split(" of ")[1].split(" is ")[0], alert.split(" is ")[1].rstrip(".\n")
        question = f"What is the desk code of {trader}? Answer with the number only."
        answers = {name: s.query(question, params).text.strip() for name, s in (("window", window), ("full", full))}
        if sparse is not None:
            answers["full_sparse"] = full.query(question, sparse).text.strip()
            right["sparse_agree"] += answers["full_sparse"] == answers["full"]
        for name, text in answers.items():
            right[name] += code in text
        right["agree"] += answers["window"] == answers["full"]
    return {"window_evicted": window.info()["evicted_tokens"],
            **{f"window_{k}": v / max(1, len(alerts)) for k, v in right.items()}}


def _exit_check(llm, standing, fed: list[str], params) -> dict:
    """The trend question to the session that may exit at its ready position: did it, how fast, and
    is its answer the computed one (the same tokens as a plain request) and the bars' trend?"""
    start = time.perf_counter()
    answer = standing.query(TREND, params)
    seconds = time.perf_counter() - start
    prompt = standing._session.prompt(llm.engine.sessions.format.question(TREND))
    computed = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].text.strip()
    closes = [float(row.split(" C ")[1].split()[0]) for row in fed if " C " in row]
    return {"exit": answer.speculative, "exit_ms": seconds * 1000 if answer.speculative else None,
            "exit_gap": standing._session.ready_exit.gap, "exit_answer": answer.text.strip(),
            "computed_answer": computed, "trend": "UP" if closes[-1] > closes[-min(11, len(closes))] else "DOWN"}


def _exit_summary(steps: list[dict]) -> dict:
    exits = [r for r in steps if r["exit"]]

    def share(rows, same) -> float | None:
        return sum(map(same, rows)) / len(rows) if rows else None

    return {"speculative exit rate": len(exits) / len(steps),
            "exit answer = computed answer": share(exits, lambda r: r["exit_answer"] == r["computed_answer"]),
            "exit answer = trend of the bars": share(exits, lambda r: r["exit_answer"] == r["trend"]),
            "computed answer = trend of the bars": share(steps, lambda r: r["computed_answer"] == r["trend"]),
            "exit latency, worst (ms)": max((r["exit_ms"] for r in exits), default=None)}


def _print_progress(steps: list[dict], shown: int) -> int:
    for row in steps[shown:]:
        print(f"step {row['step']:2d}: {row['context_tokens']:6d} tokens, session {row['session_ms']:.0f} ms, "
              f"stateless {row['stateless_ms']:.0f} ms, cached {row['stateless_cached_ms']:.0f} ms"
              + "".join(f", {k[:-3]} {v:.0f} ms" for k, v in row.items() if k.startswith(("llama", "vllm"))),
              file=sys.stderr, flush=True)
    return len(steps)


def _summary(args, steps: list[dict], peers: list[str]) -> dict:
    first, last = steps[0], steps[-1]
    busy = [r["while_ingesting_ms"] for r in steps if r["while_ingesting_ms"]]
    unstopped = [r["while_ingesting_unstopped_ms"] for r in steps if r["while_ingesting_unstopped_ms"]]
    idle = [r["session_ms"] for r in steps]
    summary = {
        "flatness (last / first session latency)": last["session_ms"] / first["session_ms"],
        "stateless / session at the end": last["stateless_ms"] / last["session_ms"],
        "stateless cached / session at the end": last["stateless_cached_ms"] / last["session_ms"],
        "flash hit, worst (ms)": max(r["flash_hit_ms"] for r in steps),
        "query p99 while ingesting / idle": _p99(busy) / _p99(idle) if busy else None,
        "the same, chunks not stopped": _p99(unstopped) / _p99(idle) if unstopped else None,
        "window accuracy (recent bars)": statistics.mean(r["window_window"] for r in steps),
        "full-context accuracy (recent bars)": statistics.mean(r["window_full"] for r in steps),
        "window agrees with full context": statistics.mean(r["window_agree"] for r in steps),
        **_exit_summary(steps),
    }
    if "session_sparse_ms" in last:  # --sparse
        summary.update({
            "flatness, sparse session": last["session_sparse_ms"] / first["session_sparse_ms"],
            "sparse session answers = dense session's": statistics.mean(r["sparse_agree"] for r in steps),
            "full-context accuracy, sparse (recent bars)": statistics.mean(r["window_full_sparse"] for r in steps),
            "sparse agrees with full context (recent bars)": statistics.mean(r["window_sparse_agree"] for r in steps)})
        for peer in peers:
            summary[f"{peer} cached / sparse session at the end"] = \
                last[f"{peer}_cached_ms"] / last["session_sparse_ms"]
    for peer in peers:
        summary[f"{peer} cached / session at the end"] = last[f"{peer}_cached_ms"] / last["session_ms"]
        summary[f"{peer} / session at the end"] = last[f"{peer}_ms"] / last["session_ms"]
    sparse = "session_sparse_ms" in last
    headers = ["step", "tokens", "session", *(["session, sparse"] if sparse else []), "flash hit", "while ingesting",
               "chunk not stopped", "stateless", "stateless cached"]
    headers += [h for peer in peers for h in (peer, f"{peer} cached")]
    headers += ["ingest tok/s"]
    table = []
    for r in steps:
        row = [r["step"], r["context_tokens"], _ms(r["session_ms"]), *([_ms(r["session_sparse_ms"])] if sparse else []),
               _ms(r["flash_hit_ms"], 3),
               _ms(r["while_ingesting_ms"]), _ms(r["while_ingesting_unstopped_ms"]), _ms(r["stateless_ms"]),
               _ms(r["stateless_cached_ms"])]
        row += [_ms(r[f"{peer}{kind}_ms"]) for peer in peers for kind in ("", "_cached")]
        row += [f"{r['ingest_tok_s']:.0f}" if r["ingest_tok_s"] else "-"]
        table.append(row)
    harness.print_table(headers, table, title=f"time to a one-token answer (ms), median of {len(QUESTIONS)} questions"
                                              f"{f' asked {args.repeats} times' if args.repeats > 1 else ''}")
    harness.print_table(["measure", "value"], [[k, f"{v:.3f}" if v is not None else "-"] for k, v in summary.items()])
    return {"benchmark": "session", "model": args.model or "SmolLM2-135M-Instruct",
            "quantization": args.quantization, "sparse": args.sparse, "sparse_budget": args.sparse_budget,
            "repeats": args.repeats, "steps": steps, "summary": summary, "machine": harness.machine_info()}


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def _ms(value, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


class _LlamaCpp:
    """llama-cpp-python on the model's GGUF, in a process of its own (benchmarks/llama_cpp_peer.py):
    it keeps the previous call's KV (longest common prefix)."""

    name = "llama.cpp"

    def __init__(self, gguf, n_ctx: int, threads: int):
        self.peer = LlamaCppPeer(gguf, n_ctx, threads)

    def answer(self, ids: list[int]) -> float:
        """Seconds to the first generated token after `ids` (reusing the cached common prefix)."""
        return self.peer.first_token(ids)


class _Vllm:
    """A vLLM server (its prefix cache on): token-id prompts to /v1/completions."""

    name = "vllm"

    def __init__(self, url: str):
        import httpx

        self.client, self.url = httpx.Client(timeout=600), url.rstrip("/")
        self.model = self.client.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def answer(self, ids: list[int]) -> float:
        start = time.perf_counter()
        r = self.client.post(f"{self.url}/v1/completions",
                             json={"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - start


def _llama(args):
    if not args.llama_cpp:
        return None
    gguf, why = peer_gguf(args.model)
    if gguf is None:
        print(f"llama.cpp: {why}; skipping it", file=sys.stderr)
        return None
    return _LlamaCpp(gguf, n_ctx=args.max_context + 1024, threads=harness.configure_threads())


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("session", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
