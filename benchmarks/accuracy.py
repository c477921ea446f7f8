"""Accuracy of position-independent spans: multi-document key-value retrieval, spans off vs link policies,
with each condition's warm-shuffled time to first token.

Tasks (--tasks; documents from benchmarks/fact_docs.py, facts "The access code of <name> is <number>."):
  generated  made-up encyclopedia paragraphs (the generator of benchmarks/rag.py), about --doc-tokens tokens,
             with --facts-per-doc facts each
  real       held-out real English prose: passages of whole sentences from the "eval" split of
             spanserve/corpus.py (U.S. State of the Union addresses; no address of it is in "train"), at most
             --real-doc-tokens tokens (median about 0.9 of that), one fact inserted between two sentences
Names are made up and unique; codes have 4-6 digits and appear nowhere else in their document. A question
asks for one person's code; the document holding the answer sits first, in the middle or last among N
documents (--docs). The same documents serve the three depths (reordered), so a span computed for one order
is reused at other positions by the next. --questions sets per N: 3x that many questions per N and condition.

Conditions, on the same token ids (the chat rendered with the documents as spans, i.e. each document
padded to whole KV blocks):
  spans off   no spans: an ordinary prompt
  none        spans reused as computed alone
  gap16/gap32 the first 16/32 tokens of every span recomputed in context
  blend0.15   CacheBlend: the 15% of span tokens whose layer-1 K/V deviate most recomputed
  full        spans ignored: must equal spans off (the reference of the first-token agreement)
  text        (extra) the documents as plain text without block padding: what a user would send
  any other link policy the engine accepts (benchmarks/rag.py parse_policy; e.g. comb): by default each one
              of spanserve/pic/link.py beyond these that a probe request shows the engine can serve
  first_in_context, first_span_only
              (diagnostics, not in the default list; link policy none) only the documents after the
              first are spans, or only the first is: which documents' independence costs accuracy
The cache is reset before each condition. Greedy decoding, --max-tokens; exact match when the first number
in the output is the code (the answer prefix of the default style makes the number come first).
First-token agreement: the fraction of questions whose first generated token equals full's. Prompts go to
the engine in one batch per (condition, N, depth). Under a focus probe (+focusK, +focusKt): answer linked,
the fraction of questions whose probe recomputed in context every token of the answer's code, and the
exact match among those (a miss is then the probe's, or the recompute's). Each answer's record names
whose code it gave (`code_of`: the asked person, another person in the prompt, or nobody).

Warm-shuffled TTFT, right after each condition's accuracy pass, at N=--ttft-docs (default the largest N),
--ttft-repeats times: a question set's documents are sent once in an order the pass used (untimed; it
makes sure they are cached even if the pass evicted them), then alone and timed, shuffled into a new order
(another first document) with a new question about another document, max_tokens=1. With spans every
document hits the cache at a new position; spans off, full and text reuse only the prefix before the
first document. Every condition gets the same prompts; reported: the median of the engine's TTFT, and
spans off's median over it.

--reuse-answers FILE takes spans off's answers (or --reuse-conditions') from an earlier run of the same
questions instead of asking again: an hour of prefill at N=16 on a 0.5B model here. Each question must
match prompt for prompt, model and dtype too; TTFT is still measured, and the JSON names the file.

    python -m benchmarks.accuracy [--quick] [--tasks generated,real] [--docs 8,16]
    spanserve bench accuracy --model qwen2.5-coder-0.5b-instruct
"""

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from benchmarks import harness
from benchmarks.accuracy_prompts import (
    CONDITIONS,
    DEFAULT_STYLE,
    DEPTHS,
    STYLES,
    build_prompts,
    choose_conditions,
    condition_params,
    condition_prompt,
    make_questions,
    order_for,
)
from benchmarks.fact_docs import FactMaker, RealFactMaker
from benchmarks.rag import git_state, parse_policy

TASKS = ("generated", "real")
GOAL_POINTS = 2.0  # gap policies: exact-match accuracy within this many points of spans off


def make_maker(task: str, tokenizer, args: argparse.Namespace):
    if task == "generated":
        return FactMaker(tokenizer, args.doc_tokens, args.facts_per_doc, args.seed)
    return RealFactMaker(tokenizer, args.real_doc_tokens, args.seed)


_NUMBER = re.compile(r"\d+")


def first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def evaluate(llm, items: list[dict], conditions: list[str], max_tokens: int, log, timing=None,
             reused: dict | None = None) -> tuple[dict, dict]:
    """Run every condition over every item, then time it with `timing(condition)` if given; returns
    ({condition: [per-item records]}, {condition: timing's result}). A condition in `reused` takes
    those records instead of asking again (its timing still runs)."""
    results: dict[str, list] = {}
    timings: dict[str, dict] = {}
    groups: dict[tuple, list[int]] = {}
    for k, item in enumerate(items):
        groups.setdefault((item["n"], item["depth"]), []).append(k)
    for condition in conditions:
        llm.engine.kv.pool.reset_cache()
        params = condition_params(condition, max_tokens)
        taken = reused is not None and condition in reused
        records: list[dict | None] = reused[condition] if taken else [None] * len(items)
        started = time.perf_counter()
        for indices in [] if taken else groups.values():  # one batch per (N, depth): depths reuse earlier spans
            with recording_links(llm) as linked:
                outs = llm.generate([condition_prompt(items[k]["prompt"], condition) for k in indices], params)
            for k, out in zip(indices, outs):
                text = out.outputs[0].text
                prompt = items[k]["prompt"]
                chosen = linked.get(tuple(prompt["ids"]))
                records[k] = {"text": text, "token_ids": out.outputs[0].token_ids,
                              "correct": first_number(text) == items[k]["answer"],
                              "cached_tokens": out.num_cached_tokens,
                              "answer_linked": None if chosen is None else chosen >= set(prompt["answer_tokens"])}
        results[condition] = records
        acc = sum(r["correct"] for r in records) / len(records)
        note = ""
        if timing:
            timings[condition] = timing(condition)
            note = f", warm-shuffled TTFT {timings[condition]['median_ttft_s'] * 1000:.0f} ms"
        note += " (answers reused)" if taken else ""
        log(f"  {condition}: accuracy {acc:.3f}{note} ({time.perf_counter() - started:.0f} s, "
            f"load average {os.getloadavg()[0]:.2f})")
    return results, timings


@contextmanager
def recording_links(llm):
    """{prompt token ids: the span tokens its focus probe linked} for the requests run inside: did
    the probe take the answer? (a diagnostic of focus_spans / focus_tokens conditions)."""
    runner, linked = llm.engine.runner, {}
    select = runner.focus_select

    def record(req, link):
        chosen = select(req, link)
        linked[tuple(req.prompt_token_ids)] = set(chosen)
        return chosen

    runner.focus_select = record
    try:
        yield linked
    finally:
        del runner.focus_select  # the class's method again


def reused_answers(path: str, task: str, style: str, items: list[dict], conditions: list[str],
                   identity: dict) -> dict:
    """{condition: records} for the `conditions` an earlier run's JSON answered, item for item.
    Every question must be the same prompt (N, depth, set, name, answer, prompt length, span
    boundaries and answer tokens), from the same model and dtype: otherwise this run stops."""
    data = json.loads(Path(path).read_text())
    for key, value in identity.items():
        if data.get(key) != value:
            raise SystemExit(f"--reuse-answers {path}: its {key} is {data.get(key)!r}, this run's is {value!r}")
    stored = data.get("tasks", {}).get(task, {}).get("questions", {}).get(style)
    if stored is None:
        raise SystemExit(f"--reuse-answers {path}: no {task!r} task in style {style!r}")
    by_key = {(r["n"], r["depth"], r["set"]): r for r in stored}
    out: dict[str, list] = {c: [] for c in conditions}
    for item in items:
        r = by_key.get((item["n"], item["depth"], item["set"]))
        prompt = item["prompt"]
        same = r is not None and (r["name"], r["answer"], r["prompt_tokens"], r["spans"]) == (
            item["name"], item["answer"], len(prompt["ids"]), prompt["spans"]) and (
            r.get("answer_tokens", prompt["answer_tokens"]) == prompt["answer_tokens"])
        if not same:
            raise SystemExit(f"--reuse-answers {path}: question N={item['n']} {item['depth']} set {item['set']} "
                             f"differs from this run's (another seed, documents or engine?)")
        for c in conditions:
            if c not in r:
                raise SystemExit(f"--reuse-answers {path}: no answers for condition {c!r}")
            a = r[c]
            out[c].append({"text": a["text"], "token_ids": a.get("token_ids", a["first_token"]),
                           "correct": first_number(a["text"]) == item["answer"],
                           "cached_tokens": a.get("cached_tokens"), "answer_linked": a.get("answer_linked")})
    return out


# ---- warm-shuffled TTFT ----------------------------------------------------------------------


def ttft_plan(llm, sets: list[dict], repeats: int, style: str, seed: int) -> list[dict]:
    """The prompts of each timing repeat, the same for every condition: the warm-up in the pass's
    "first" order with the pass's question, and the timed one shuffled with a question on another document."""
    rng = random.Random(seed)
    plan = []
    for r in range(repeats):
        j = r % len(sets)
        q = sets[j]
        warm = order_for(q, "first")
        order = new_order(rng, q)
        other = [i for i in range(len(q["docs"])) if i != q["target"]] or [q["target"]]
        doc = rng.choice(other)
        name = rng.choice(list(q["docs"][doc]["facts"]))
        asked = {**q, "name": name}
        plan.append({"set": j, "order": order, "name": name, "answer": q["docs"][doc]["facts"][name],
                     "warm_prompt": build_prompts(llm, q, warm, style),
                     "prompt": build_prompts(llm, asked, order, style)})
    return plan


def new_order(rng: random.Random, q: dict) -> list[int]:
    """A shuffle of the set's documents whose first one opens none of the pass's orders, so that
    spans off can reuse nothing past the system prompt (at N=2 one must: then not the warm-up's)."""
    n, firsts = len(q["docs"]), {order_for(q, depth)[0] for depth in DEPTHS}
    order = list(range(n))
    for _ in range(1000):
        rng.shuffle(order)
        if order[0] not in firsts or (len(firsts) >= n and order[0] != q["target"]):
            break
    return order


def warm_shuffled_ttft(llm, plan: list[dict], condition: str) -> dict:
    """Median TTFT of the plan's timed prompts under `condition`, each after its untimed warm-up."""
    params = condition_params(condition, 1)
    runs = []
    for step in plan:
        warm = llm.generate(condition_prompt(step["warm_prompt"], condition), params)[0]
        out = llm.generate(condition_prompt(step["prompt"], condition), params)[0]
        runs.append({"set": step["set"], "order": step["order"], "ttft_s": out.metrics.ttft_s,
                     "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                     "warm_cached_tokens": warm.num_cached_tokens})
    return {"median_ttft_s": statistics.median(r["ttft_s"] for r in runs), "runs": runs}


def add_speedups(timings: dict) -> dict:
    """Each condition's spans-off median over its own (how many times faster than spans off)."""
    base = timings.get("spans_off", {}).get("median_ttft_s")
    for t in timings.values():
        t["speedup_vs_spans_off"] = base / t["median_ttft_s"] if base and t["median_ttft_s"] else None
    return timings


# ---- summaries -------------------------------------------------------------------------------


def summarize(items: list[dict], results: dict) -> dict:
    """Accuracy and agreement with full: overall, per N, and per (N, depth)."""
    reference = results.get("full")

    def agree(rs: list[dict], indices: list[int], same) -> float:
        return sum(same(r, reference[k]) for r, k in zip(rs, indices)) / len(rs)

    def same_number(a: dict, b: dict) -> bool:
        return first_number(a["text"]) == first_number(b["text"])

    def stats(indices: list[int]) -> dict:
        out = {}
        for condition, records in results.items():
            rs = [records[k] for k in indices]
            row = {"accuracy": sum(r["correct"] for r in rs) / len(rs), "questions": len(rs)}
            probed = [r for r in rs if r.get("answer_linked") is not None]
            if probed:  # a focus probe ran: how often it linked the answer, and what that was worth
                took = [r for r in probed if r["answer_linked"]]
                row["answer_linked"] = len(took) / len(probed)
                row["accuracy_answer_linked"] = sum(r["correct"] for r in took) / len(took) if took else None
            if reference:
                row["first_token_agreement"] = agree(rs, indices, lambda a, b: a["token_ids"][:1] == b["token_ids"][:1])
                row["answer_agreement"] = agree(rs, indices, same_number)
                row["output_agreement"] = agree(rs, indices, lambda a, b: a["token_ids"] == b["token_ids"])
            out[condition] = row
        return out

    per_n: dict[str, list[int]] = {}
    cells: dict[str, list[int]] = {}
    for k, item in enumerate(items):
        per_n.setdefault(f"N={item['n']}", []).append(k)
        cells.setdefault(f"N={item['n']} {item['depth']}", []).append(k)
    return {"overall": stats(list(range(len(items)))), "per_n": {n: stats(ks) for n, ks in per_n.items()},
            "cells": {c: stats(ks) for c, ks in cells.items()}}


def check_goals(summary: dict, doc_tokens: int) -> dict:
    """The issue's goal for gap policies; a gap as long as the documents recomputes them whole
    (it is `full`), so it does not count."""
    overall = summary["overall"]
    goals = {}
    if "spans_off" in overall:
        base = overall["spans_off"]["accuracy"]
        for condition in overall:
            if condition.startswith("gap") and parse_policy(condition)["gap_length"] < doc_tokens:
                diff = (overall[condition]["accuracy"] - base) * 100
                goals[f"{condition} within {GOAL_POINTS:g} points of spans off"] = {
                    "points": diff, "need": -GOAL_POINTS, "met": diff >= -GOAL_POINTS}
        if "full" in overall:
            same = overall["full"]["accuracy"] == base
            goals["full == spans off"] = {"points": (overall["full"]["accuracy"] - base) * 100, "need": 0.0,
                                          "met": same}
    return goals


# ---- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: generated, real")
    parser.add_argument("--docs", default="8,16", help="document counts N, comma-separated")
    parser.add_argument("--questions", type=int, default=34,
                        help="question sets per N and task; each is asked at the three depths (default: 102 per N)")
    parser.add_argument("--doc-tokens", type=int, default=128, help="generated task: tokens per document (at most)")
    parser.add_argument("--facts-per-doc", type=int, default=3, help="generated task: facts in each document")
    parser.add_argument("--real-doc-tokens", type=int, default=256,
                        help="real task: tokens per document (at most; the median is about 0.9 of it)")
    parser.add_argument("--conditions", default=None,
                        help="comma-separated: spans_off, text, a link policy (none, full, gapK, blendR, or any other "
                             "the engine accepts, e.g. comb), or a diagnostic (first_in_context, first_span_only); "
                             f"default: {','.join(CONDITIONS)} and every other link policy the engine can serve")
    parser.add_argument("--ttft-docs", type=int, default=None, help="N of the warm-shuffled TTFT (default: largest N)")
    parser.add_argument("--ttft-repeats", type=int, default=5,
                        help="warm-shuffled TTFT: median of this many prompts per condition and task (0: skip)")
    parser.add_argument("--style", default=DEFAULT_STYLE, choices=list(STYLES), help="prompt phrasing")
    parser.add_argument("--styles", default=None,
                        help="compare prompt styles (comma-separated, or 'all') with spans off only, then exit")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens to generate (default: 8 for a style with an answer prefix, else 16)")
    parser.add_argument("--model", default=None,
                        help="model name, HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 on CPUs with native bf16)")
    parser.add_argument("--comb-plugin", default=None,
                        help="COMB encoder plug-in file for link policy comb (default: the one shipped for the model)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="KV pool size (default: the engine's); a batch's documents (question sets x N) "
                             "should fit, or the later depths recompute what the earlier ones cached")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N=3, 2 question sets, short documents, 2 TTFT repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse-answers", default=None, metavar="FILE",
                        help="take the answers of --reuse-conditions from an earlier run's JSON of the same "
                             "questions instead of asking again (checked prompt by prompt); TTFT is still measured")
    parser.add_argument("--reuse-conditions", default="spans_off",
                        help="comma-separated conditions --reuse-answers takes (default: spans_off, the exact path)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/accuracy-<model>[-quick].json)")


def apply_quick(args: argparse.Namespace) -> None:
    args.docs, args.questions, args.doc_tokens, args.facts_per_doc = "3", 2, 64, 2
    args.real_doc_tokens, args.ttft_repeats, args.ttft_docs = 96, 2, None


def run(args: argparse.Namespace) -> dict:
    loadavg_before = list(os.getloadavg())
    threads = harness.configure_threads(args.threads)
    git = git_state()  # at the start: the engine is imported now, edits during the run do not count
    from spanserve import LLM
    from spanserve.models.loader import DEFAULT_MODEL

    if args.quick:
        apply_quick(args)
    counts = [int(x) for x in str(args.docs).split(",")]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if unknown := set(tasks) - set(TASKS):
        raise SystemExit(f"unknown task(s) {sorted(unknown)}: use {', '.join(TASKS)}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    model_name = Path(args.model).name if args.model else DEFAULT_MODEL
    pool = {"kv_cache_memory_gb": args.kv_cache_gb} if args.kv_cache_gb else {}
    llm = LLM(model=args.model, dtype=args.dtype, comb_plugin=args.comb_plugin, **pool)
    if args.styles:
        styles = list(STYLES) if args.styles == "all" else args.styles.split(",")
        conditions, skipped = ["spans_off"], {}
    else:
        styles = [args.style]
        conditions, skipped = choose_conditions(llm, args.conditions, log)
    if args.reuse_answers and "full" in set(conditions) - set(args.reuse_conditions.split(",")):
        raise SystemExit("--reuse-answers: full is the reference of the agreement columns; reuse it too or drop it")
    identity = {"model": model_name, "dtype": str(llm.engine.dtype).removeprefix("torch.")}  # what answers depend on
    ttft_n = args.ttft_docs or max(counts)
    name = ("accuracy-styles" if args.styles else "accuracy") + f"-{model_name}" + ("-quick" if args.quick else "")
    per_task: dict = {}
    for task in tasks:  # each task is printed and written as soon as it is done: a stopped run keeps them
        per_task[task] = run_task(llm, task, args, counts, conditions, styles, ttft_n, log, identity)
        report_task(task, per_task[task], conditions, model_name, llm, threads, ttft_n)
        data = {
            "benchmark": "accuracy",
            **identity,
            "quick": args.quick,
            "args": dict(vars(args)),
            "conditions": conditions,
            "skipped_conditions": skipped,
            "comb_plugin": plugin_facts(llm.engine.comb),
            "reused_answers": args.reuse_answers and {"file": args.reuse_answers,
                                                      "conditions": args.reuse_conditions.split(",")},
            "styles": {s: {"system": STYLES[s][0], "question": STYLES[s][1], "answer_prefix": STYLES[s][2]}
                       for s in styles},
            "machine": harness.machine_info(),
            "git": git,
            "loadavg_before": loadavg_before,
            "loadavg_after": list(os.getloadavg()),
            "elapsed_s": time.perf_counter() - started,
            "complete": len(per_task) == len(tasks),
            "ttft_metric": f"median engine TTFT in seconds at N={ttft_n}, warm-shuffled (see the module docstring)",
            "tasks": {task: {**{k: v for k, v in r.items() if k != "styles"},
                             "summary": {s: x["summary"] for s, x in r["styles"].items()},
                             "questions": {s: _records(x["items"], x["results"]) for s, x in r["styles"].items()}}
                      for task, r in per_task.items()},
        }
        harness.write_json(data, name=name, path=args.out)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return data


def plugin_facts(plugin) -> dict | None:
    """Which COMB plug-in answered: its KV signature, focus-probe heads and training steps."""
    if plugin is None:
        return None
    return {"signature": plugin.signature, "probe_heads": plugin.probe_heads, "steps": plugin.meta.get("steps")}


def report_task(task: str, r: dict, conditions: list[str], model: str, llm, threads: int, ttft_n: int) -> None:
    for i, (style, s) in enumerate(r["styles"].items()):
        print_tables(task, style, s["summary"], r["ttft"] if i == 0 else {}, conditions, model, llm, threads, ttft_n)
    if r["goals"]:
        print(f"\ngoals ({task}):")
        for key, g in r["goals"].items():
            print(f"  {key}: {g['points']:+.1f} points -> {'met' if g['met'] else 'NOT met'}")
    sys.stdout.flush()


def run_task(llm, task: str, args, counts: list[int], conditions: list[str], styles: list[str], ttft_n: int,
             log, identity: dict) -> dict:
    """One task's question sets, asked in each style under every condition; TTFT for the main style."""
    maker = make_maker(task, llm.get_tokenizer(), args)
    sets = {n: make_questions(maker, n, args.questions) for n in counts}
    lengths = sorted(maker.filler.count(d["text"]) for qs in sets.values() for q in qs for d in q["docs"])
    out: dict = {"doc_tokens": {"limit": args.real_doc_tokens if task == "real" else args.doc_tokens,
                                "min": lengths[0], "median": statistics.median(lengths), "max": lengths[-1]},
                 "styles": {}, "ttft": {}}
    for style in styles:
        items = [{"task": task, "n": n, "depth": depth, "set": j, "name": q["name"], "answer": q["answer"],
                  "prompt": build_prompts(llm, q, order_for(q, depth), style), "owners": code_owners(q)}
                 for n in counts for depth in DEPTHS for j, q in enumerate(sets[n])]
        timing, reused = None, None
        if args.reuse_answers and style == styles[0]:
            reuse = [c for c in args.reuse_conditions.split(",") if c in conditions]
            reused = reused_answers(args.reuse_answers, task, style, items, reuse, identity)
        if style == styles[0] and not args.styles and args.ttft_repeats and ttft_n in sets:
            plan = ttft_plan(llm, sets[ttft_n], args.ttft_repeats, style, args.seed + 1)
            timing = partial(warm_shuffled_ttft, llm, plan)
        log(f"task {task!r}, style {style!r}: {len(items)} questions x {len(conditions)} conditions "
            f"(documents of {out['doc_tokens']['median']:.0f} tokens; load average {os.getloadavg()[0]:.2f})")
        max_tokens = args.max_tokens or (8 if STYLES[style][2] else 16)
        results, timings = evaluate(llm, items, conditions, max_tokens, log, timing, reused)
        out["styles"][style] = {"items": items, "results": results, "summary": summarize(items, results)}
        out["ttft"] = add_speedups(timings) if timing else out["ttft"]
    main = out["styles"][styles[0]]["summary"]
    out["goals"] = {} if args.styles else check_goals(main, out["doc_tokens"]["limit"])
    return out


def print_tables(task: str, style: str, summary: dict, ttft: dict, conditions: list[str], model: str, llm,
                 threads: int, ttft_n: int) -> None:
    pct = lambda v: None if v is None else f"{100 * v:.1f}"  # noqa: E731
    overall, per_n = summary["overall"], summary["per_n"]
    base = overall.get("spans_off", {}).get("accuracy")
    headers = ["condition", *(f"exact % {n}" for n in per_n), "exact % all", "vs spans off (points)",
               "first token = full %", "number = full %", "answer linked %", "exact % if linked"]
    if ttft:
        headers += [f"TTFT ms N={ttft_n} warm shuffled", "x faster than spans off"]
    rows = []
    for c in conditions:
        row = [c, *(pct(per_n[n][c]["accuracy"]) for n in per_n), pct(overall[c]["accuracy"]),
               None if base is None else f"{100 * (overall[c]['accuracy'] - base):+.1f}",
               pct(overall[c].get("first_token_agreement")), pct(overall[c].get("answer_agreement")),
               pct(overall[c].get("answer_linked")), pct(overall[c].get("accuracy_answer_linked"))]
        if ttft:
            t = ttft[c]
            row += [t["median_ttft_s"] * 1000, None if t["speedup_vs_spans_off"] is None
                    else f"{t['speedup_vs_spans_off']:.1f}x"]
        rows.append(row)
    questions = {n: next(iter(s.values()))["questions"] for n, s in per_n.items()}
    harness.print_table(headers, rows, title=f"{task} retrieval, style {style!r} ({model}, {llm.engine.dtype}, "
                                             f"{threads} threads; questions per condition: "
                                             + ", ".join(f"{q} at {n}" for n, q in questions.items()) + ")")
    cells = list(summary["cells"])
    rows = [[c, *(pct(summary["cells"][cell][c]["accuracy"]) for cell in cells)] for c in conditions]
    per_cell = summary["cells"][cells[0]][conditions[0]]["questions"]
    harness.print_table(["exact match %", *cells], rows, title=f"{task}: per N and depth ({per_cell} questions each)")


def code_owners(q: dict) -> dict[str, str]:
    """Every code in a question set's documents -> whose it is: a wrong answer that is another
    person's code shows which fact the model read instead (a namesake's, often)."""
    return {code: name for doc in q["docs"] for name, code in doc["facts"].items()}


def _records(items: list[dict], results: dict) -> list[dict]:
    out = []
    for k, item in enumerate(items):
        out.append({
            "n": item["n"], "depth": item["depth"], "set": item["set"], "name": item["name"], "answer": item["answer"],
            "prompt_tokens": len(item["prompt"]["ids"]), "spans": item["prompt"]["spans"],
            "answer_tokens": item["prompt"]["answer_tokens"],
            **{c: {"text": r[k]["text"], "correct": r[k]["correct"], "cached_tokens": r[k]["cached_tokens"],
                   "first_token": r[k]["token_ids"][:1], "token_ids": list(r[k]["token_ids"]),
                   "answer_linked": r[k]["answer_linked"],
                   "code_of": item["owners"].get(first_number(r[k]["text"]))}
               for c, r in results.items()},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("accuracy", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
