"""`spanserve session`: stream a CSV file into a session and answer questions as rows arrive.

    spanserve session data.csv --question "What is the latest reading?" --every 50 [--rows-per-append 10]

Rows are appended as text lines (the header first, so the model knows the columns), a few at a
time, as a feed would deliver them; every --every rows the questions are asked over the data
ingested by then, each answer printed with its data version and latency. Registered (--flash)
questions are answered by the engine after each ingest: their answers print when they change.
With --exit-answers (say ALERT,OK, with instructions that pose one standing question), a question
is answered from the model's assessment of the data alone when that is confident enough
(sessions/ready.py); such answers print as speculative.
"""

import argparse
import csv
import time
from pathlib import Path

from spanserve.errors import InvalidRequestError
from spanserve.sessions.ready import DEFAULT_THRESHOLD


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("csv", help="the CSV file (its first row names the columns)")
    p.add_argument("--question", action="append", default=[], help="asked every --every rows (repeatable)")
    p.add_argument("--flash", action="append", default=[], help="a registered question, answered after each ingest")
    p.add_argument("--every", type=int, default=50, help="ask the questions after this many rows")
    p.add_argument("--rows-per-append", type=int, default=10, help="rows per append (a feed's batch)")
    p.add_argument("--retention-tokens", type=int, default=None, help="data kept (default: the model's length "
                   "less room for a question); older rows are dropped")
    p.add_argument("--session-system", default="You answer questions about the data rows below, briefly.",
                   help="the session's instructions")
    p.add_argument("--exit-answers", default="", help="comma-separated fast answers of ready-position "
                   "speculative exit (default: off)")
    p.add_argument("--exit-threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="the logit lead the top answer needs to exit (default %(default)s)")


def rows(path: str):
    """The CSV's lines, each as the comma-separated text of its cells."""
    if not Path(path).is_file():
        raise InvalidRequestError(f"no CSV file {path}")
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        for cells in csv.reader(f):
            yield ", ".join(cells) + "\n"


def run(args, llm, params) -> None:
    if args.every < 1 or args.rows_per_append < 1:
        raise InvalidRequestError("--every and --rows-per-append must be >= 1")
    answers = [a for a in args.exit_answers.split(",") if a.strip()]
    session = llm.create_session(args.session_system, args.retention_tokens, args.flash,
                                 exit_answers=answers, exit_threshold=args.exit_threshold)
    shown: dict[str, int] = {}
    batch, count = [], 0
    for line in rows(args.csv):
        batch.append(line)
        count += 1
        if len(batch) == args.rows_per_append:
            session.append("".join(batch))
            batch = []
        if count % args.every == 0 and args.question:
            if batch:
                session.append("".join(batch))
                batch = []
            session.wait()
            _ask(session, args.question, params, count)
        _show_flash(session, shown)
    if batch:
        session.append("".join(batch))
    session.wait()
    if args.question and count % args.every:
        _ask(session, args.question, params, count)
    _show_flash(session, shown)
    info = session.info()
    print(f"\n{count} rows: {info['num_tokens']} tokens kept, {info['evicted_tokens']} evicted")
    session.close()


def _ask(session, questions: list[str], params, count: int) -> None:
    for question in questions:
        start = time.perf_counter()
        answer = session.query(question, params)
        seconds = time.perf_counter() - start
        ttft = answer.output.metrics.ttft_s if answer.output else 0.0
        how = "speculative, " if answer.speculative else "flash, " if answer.flash_hit else ""
        print(f"[{count} rows, v{answer.version}] {question}\n    {answer.text.strip()}   "
              f"({how}first token {ttft * 1000:.0f} ms, answer {seconds * 1000:.0f} ms)", flush=True)


def _show_flash(session, shown: dict[str, int]) -> None:
    for question, (version, answer) in session.flash_answers().items():
        if answer is not None and shown.get(question) != version:
            shown[question] = version
            print(f"[flash v{version}] {question}\n    {answer.strip()}", flush=True)
