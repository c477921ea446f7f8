"""Session questions over HTTP while the session ingests: what a client of `spanserve serve` sees.

Starts `spanserve serve` (--model, default the embedded SmolLM2; --serve-args for the rest),
creates a session and feeds it --context tokens of price bars (benchmarks/session.py's feed),
then asks one-token questions with a random pause before each (--pause-s, uniform), --questions
of them while the session is idle and as many while it ingests --ingest more bars (stopping when
the ingest ends). Background chunks stop for an arriving request and shrink while requests keep
arriving (scheduler.BackgroundPace); this is where that shows, through the server's engine thread.

Reports the questions' p50 / p99 latency, idle and during ingest, their ratio (the sessions
issue's goal: a concurrent ingest raises query p99 at most 2x), the ingest's seconds and tok/s
(questions included, as a server lives them), and the background steps the server stopped.

    spanserve bench session_server [--context 4600] [--ingest 2000] [--questions 12]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.serve import percentile
from benchmarks.server_process import ServerProcess, metrics
from benchmarks.session import QUESTIONS, SYSTEM, bars

TOKENS_PER_BAR = 46  # about (SmolLM2's tokenizer): how many bars make the data asked for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded SmolLM2)")
    parser.add_argument("--context", type=int, default=4600, help="data tokens before the questions, about")
    parser.add_argument("--ingest", type=int, default=2000, help="data tokens appended while asking, about")
    parser.add_argument("--questions", type=int, default=12, help="questions asked idle, and at most as many during")
    parser.add_argument("--pause-s", type=float, nargs=2, default=(0.1, 0.6), help="pause before each question")
    parser.add_argument("--serve-args", default="--quantization w8a8",
                        help="`spanserve serve` arguments, space separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/session_server.json)")


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out) if args.out else harness.result_path("session_server")
    model = ["--model", args.model] if args.model else []
    server = ServerProcess([*model, *args.serve_args.split()], out.with_suffix(".server.log"), startup_timeout=300)
    rng = random.Random(args.seed)
    first, more = args.context // TOKENS_PER_BAR, args.ingest // TOKENS_PER_BAR
    feed = bars(first + more)
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            session = _Session(client)
            session.append("".join(feed[:first]))
            session.wait()
            idle = []
            for i in range(args.questions):
                time.sleep(rng.uniform(*args.pause_s))
                idle.append(session.ask(QUESTIONS[i % len(QUESTIONS)]))
            start, version = time.perf_counter(), session.append("".join(feed[first:]))
            busy = []
            while len(busy) < args.questions:
                time.sleep(rng.uniform(*args.pause_s))
                if session.caught_up(version):  # checked after the pause: asked while ingest runs
                    break
                busy.append(session.ask(QUESTIONS[len(busy) % len(QUESTIONS)]))
            session.wait()
            ingest_s = time.perf_counter() - start
            info = session.info()
            ingested, context = _size(info) - session.before, info["num_tokens"]
            # None from an older build that never stops a background step (an A/B of builds)
            stopped = metrics(server.url).get("spanserve_background_steps_stopped_total")
    finally:
        server.stop()
    result = {"benchmark": "session_server", "model": args.model or "SmolLM2-135M-Instruct",
              "serve_args": args.serve_args, "context_tokens": context, "idle_ms": idle,
              "during_ingest_ms": busy, "ingest_s": ingest_s, "ingest_tokens": ingested,
              "background_steps_stopped": stopped, "machine": harness.machine_info()}
    result["summary"] = _summary(result)
    _report(result)
    harness.write_json(result, path=out)
    return result


class _Session:
    """One session of the server, through its HTTP routes."""

    def __init__(self, client: httpx.Client):
        self.client = client
        reply = client.post("/v1/sessions", json={"system": SYSTEM})
        reply.raise_for_status()
        self.id, self.before = reply.json()["id"], 0

    def append(self, text: str) -> int:
        self.before = _size(self.info())
        reply = self.client.post(f"/v1/sessions/{self.id}/data", json={"text": text})
        reply.raise_for_status()
        return reply.json()["version"]

    def info(self) -> dict:
        reply = self.client.get(f"/v1/sessions/{self.id}")
        reply.raise_for_status()
        return reply.json()

    def caught_up(self, version: int | None = None) -> bool:
        info = self.info()
        return info["visible_version"] >= (info["version"] if version is None else version)

    def wait(self) -> None:
        while not self.caught_up():
            time.sleep(0.2)

    def ask(self, question: str) -> float:
        """Milliseconds to a one-token answer."""
        start = time.perf_counter()
        reply = self.client.post(f"/v1/sessions/{self.id}/query",
                                 json={"question": question, "max_tokens": 1, "temperature": 0})
        reply.raise_for_status()
        return (time.perf_counter() - start) * 1000


def _size(info: dict) -> int:
    """A session's data tokens computed so far, evicted ones included."""
    return info["num_tokens"] + info["evicted_tokens"]


def _summary(result: dict) -> dict:
    idle, busy = result["idle_ms"], result["during_ingest_ms"]
    p99 = lambda values: percentile(values, 99)  # noqa: E731
    return {"idle p50 (ms)": statistics.median(idle), "idle p99 (ms)": p99(idle),
            "during ingest p50 (ms)": statistics.median(busy) if busy else None,
            "during ingest p99 (ms)": p99(busy) if busy else None,
            "p99 during ingest / idle": p99(busy) / p99(idle) if busy else None,
            "questions during ingest": len(busy), "ingest tok/s": result["ingest_tokens"] / result["ingest_s"],
            "background steps stopped": result["background_steps_stopped"]}


def _report(result: dict) -> None:
    rows = [[k, f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else v)]
            for k, v in result["summary"].items()]
    harness.print_table(["measure", "value"], rows,
                        title=f"session questions over HTTP, {result['context_tokens']} data tokens at the end")


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("session_server", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
