"""Accuracy of position-independent spans: multi-document key-value retrieval, spans off vs link policies.

Each document is a short made-up encyclopedia paragraph (the generator of benchmarks/rag.py) with
--facts-per-doc sentences "The access code of <name> is <number>." in it (4-6 digit numbers, all names
distinct), about --doc-tokens tokens. A question asks for one person's code; the document holding the
answer sits first, in the middle or last among N documents (--docs). The same documents serve the three
depths (reordered), so a span computed for one order is reused at other positions by the next.

Conditions, on the same token ids (the chat rendered with the documents as spans, i.e. each document
padded to whole KV blocks):
  spans off   no spans: an ordinary prompt
  none        spans reused as computed alone
  gap16/gap32 the first 16/32 tokens of every span recomputed in context
  blend0.15   CacheBlend: the 15% of span tokens whose layer-1 K/V deviate most recomputed
  full        spans ignored: must equal spans off (the reference of the first-token agreement)
  text        (extra) the documents as plain text without block padding: what a user would send
  first_in_context, first_span_only
              (diagnostics, not in the default list; link policy none) only the documents after the
              first are spans, or only the first is: which documents' independence costs accuracy
The cache is reset before each condition. Greedy decoding, --max-tokens; exact match when the first
number in the output is the answer. First-token agreement: the fraction of questions whose first
generated token equals full's. Prompts go to the engine in one batch per (condition, N, depth).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.accuracy [--quick] [--docs 4,8] [--questions 17]
    spanserve bench accuracy --quick
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.rag import _TEMPLATES, DocumentMaker, git_state, parse_policy, policy_params

DEPTHS = ("first", "middle", "last")
CONDITIONS = ("spans_off", "none", "gap16", "gap32", "blend0.15", "full", "text")
GOAL_POINTS = 2.0  # gap policies: exact-match accuracy within this many points of spans off

# Prompt styles tried on SmolLM2-135M with spans off (--styles all --questions 6 --max-tokens 24: 36 questions,
# N=4,8; chance is 1/(3N), 4-8%): bare 31%, question 39%, fewshot 36%, prefix 33%, fewshot_prefix 33%, all
# within noise of each other. Each is (system message, question, start of the assistant's answer placed after
# the chat template's generation prompt). "prefix" is the default: 8 tokens hold any answer, and the first
# generated token is the answer's first digit, so first-token agreement measures the answer itself.
STYLES = {
    "bare": ("Answer with the number only.", "What is the access code of {name}?", ""),
    "question": ("You answer questions about the documents. Answer with the number only.",
                 "Question: What is the access code of {name}?\nAnswer with the number only.", ""),
    "fewshot": ("You answer questions about the documents with the number only.\n"
                "Example: for \"The access code of Jane Doe is 40712.\", the access code of Jane Doe is 40712.",
                "What is the access code of {name}?", ""),
    "prefix": ("Answer with the number only.", "What is the access code of {name}?",
               "The access code of {name} is "),  # the trailing space is a token: the answer starts with a digit
}
STYLES["fewshot_prefix"] = (STYLES["fewshot"][0], STYLES["prefix"][1], STYLES["prefix"][2])
DEFAULT_STYLE = "prefix"


class FactMaker:
    """Documents of filler sentences with access-code facts; names unique across one maker."""

    def __init__(self, tokenizer, doc_tokens: int, facts: int, seed: int = 0):
        self.filler = DocumentMaker(tokenizer, doc_tokens, seed)
        self.rng, self.doc_tokens, self.facts = self.filler.rng, doc_tokens, facts

    def person(self) -> str:
        return self.filler.person(unique=True)

    def code(self) -> str:
        digits = self.rng.randrange(4, 7)
        return str(self.rng.randrange(10 ** (digits - 1), 10 ** digits))

    def document(self) -> dict:
        """{"text", "facts": {name: code}}: facts spread among filler sentences, ~doc_tokens tokens."""
        f = self.filler
        slots = {"E": f.name(unique=False), "C": f.name(unique=False)}
        facts = {self.person(): self.code() for _ in range(self.facts)}
        sentences = [f"The access code of {name} is {code}." for name, code in facts.items()]
        templates = list(_TEMPLATES)
        self.rng.shuffle(templates)
        for template in templates:
            sentence = f.fill(template, slots)
            at = self.rng.randrange(len(sentences) + 1)
            candidate = sentences[:at] + [sentence] + sentences[at:]
            if f.count(" ".join(candidate)) > self.doc_tokens:
                break
            sentences = candidate
        return {"text": " ".join(sentences), "facts": facts}


def make_questions(maker: FactMaker, n_docs: int, count: int) -> list[dict]:
    """`count` question sets for N documents: the documents, a target (name, code) in one of them."""
    out = []
    for _ in range(count):
        docs = [maker.document() for _ in range(n_docs)]
        target = maker.rng.randrange(n_docs)
        name = maker.rng.choice(list(docs[target]["facts"]))
        out.append({"docs": docs, "target": target, "name": name, "answer": docs[target]["facts"][name]})
    return out


def order_for(q: dict, depth: str) -> list[int]:
    """Document order putting the target first, in the middle or last; the others keep their order."""
    n = len(q["docs"])
    others = [i for i in range(n) if i != q["target"]]
    at = {"first": 0, "middle": n // 2, "last": n - 1}[depth]
    return others[:at] + [q["target"]] + others[at:]


def build_prompts(llm, q: dict, order: list[int], style: str) -> dict:
    """Token prompt with spans, and the plain-text version, of one question at one depth."""
    from spanserve import Span

    system, question, prefix = STYLES[style]
    name = q["name"]
    texts = [q["docs"][i]["text"] + "\n\n" for i in order]
    ask = question.format(name=name)
    span_msgs = [{"role": "system", "content": system},
                 {"role": "user", "content": [Span(t) for t in texts] + [ask]}]
    text_msgs = [{"role": "system", "content": system}, {"role": "user", "content": "".join(texts) + ask}]
    tok = llm.get_tokenizer()
    tail = tok.encode(prefix.format(name=name), add_special_tokens=False) if prefix else []
    spanned = llm.engine.chat_prompt(span_msgs)
    return {"ids": spanned["prompt_token_ids"] + tail, "spans": [list(s) for s in spanned["spans"]],
            "text_ids": llm.apply_chat_template(text_msgs) + tail}


DIAGNOSTICS = {"first_in_context": slice(1, None), "first_span_only": slice(0, 1)}  # which spans stay


def condition_prompt(prompt: dict, condition: str) -> dict:
    if condition == "text":
        return {"prompt_token_ids": prompt["text_ids"]}
    if condition == "spans_off":
        return {"prompt_token_ids": prompt["ids"]}
    return {"prompt_token_ids": prompt["ids"], "spans": prompt["spans"][DIAGNOSTICS.get(condition, slice(None))]}


def condition_params(condition: str, max_tokens: int):
    from spanserve import SamplingParams

    if condition in ("spans_off", "text"):
        return SamplingParams(temperature=0, max_tokens=max_tokens)
    return policy_params("none" if condition in DIAGNOSTICS else condition, max_tokens)


_NUMBER = re.compile(r"\d+")


def first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def evaluate(llm, items: list[dict], conditions: list[str], max_tokens: int, log) -> dict:
    """Run every condition over every item; returns {condition: [per-item records]}."""
    results: dict[str, list] = {}
    groups: dict[tuple, list[int]] = {}
    for k, item in enumerate(items):
        groups.setdefault((item["n"], item["depth"]), []).append(k)
    for condition in conditions:
        llm.engine.kv.pool.reset_cache()
        params = condition_params(condition, max_tokens)
        records: list[dict | None] = [None] * len(items)
        started = time.perf_counter()
        for indices in groups.values():  # one batch per (N, depth): the depths reuse earlier spans
            outs = llm.generate([condition_prompt(items[k]["prompt"], condition) for k in indices], params)
            for k, out in zip(indices, outs):
                text = out.outputs[0].text
                records[k] = {"text": text, "token_ids": out.outputs[0].token_ids,
                              "correct": first_number(text) == items[k]["answer"],
                              "cached_tokens": out.num_cached_tokens}
        results[condition] = records
        acc = sum(r["correct"] for r in records) / len(records)
        log(f"  {condition}: accuracy {acc:.3f} ({time.perf_counter() - started:.0f} s, "
            f"load average {os.getloadavg()[0]:.2f})")
    return results


def summarize(items: list[dict], results: dict) -> dict:
    """Accuracy and first-token agreement with full, overall and per (N, depth)."""
    reference = results.get("full")

    def stats(indices: list[int]) -> dict:
        out = {}
        for condition, records in results.items():
            rs = [records[k] for k in indices]
            row = {"accuracy": sum(r["correct"] for r in rs) / len(rs), "questions": len(rs)}
            if reference:
                row["first_token_agreement"] = sum(
                    (r["token_ids"][:1] == reference[k]["token_ids"][:1]) for r, k in zip(rs, indices)) / len(rs)
                row["answer_agreement"] = sum(
                    (first_number(r["text"]) == first_number(reference[k]["text"])) for r, k in zip(rs, indices)
                ) / len(rs)
                row["output_agreement"] = sum(
                    (r["token_ids"] == reference[k]["token_ids"]) for r, k in zip(rs, indices)) / len(rs)
            out[condition] = row
        return out

    cells: dict[str, list[int]] = {}
    for k, item in enumerate(items):
        cells.setdefault(f"N={item['n']} {item['depth']}", []).append(k)
    return {"overall": stats(list(range(len(items)))), "cells": {c: stats(ks) for c, ks in cells.items()}}


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
    parser.add_argument("--docs", default="4,8", help="document counts N, comma-separated")
    parser.add_argument("--doc-tokens", type=int, default=128, help="tokens per document (at most)")
    parser.add_argument("--facts-per-doc", type=int, default=3, help="access-code facts in each document")
    parser.add_argument("--questions", type=int, default=17,
                        help="question sets per N; each is asked at the three depths (default: 102 in all)")
    parser.add_argument("--conditions", default=",".join(CONDITIONS),
                        help="comma-separated: spans_off, text, a link policy (none, full, gapK, blendR), "
                             "or a diagnostic (first_in_context, first_span_only)")
    parser.add_argument("--style", default=DEFAULT_STYLE, choices=list(STYLES), help="prompt phrasing")
    parser.add_argument("--styles", default=None,
                        help="compare prompt styles (comma-separated, or 'all') with spans off only, then exit")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens to generate (default: 8 for a style with an answer prefix, else 16)")
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 on CPUs with native bf16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="smoke run: N=2, 64-token documents, 2 questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/accuracy.json)")


def run(args: argparse.Namespace) -> dict:
    loadavg_before = list(os.getloadavg())
    threads = harness.configure_threads(args.threads)
    git = git_state()  # at the start: the engine is imported now, edits during the run do not count
    from spanserve import LLM
    from spanserve.models.loader import DEFAULT_MODEL

    if args.quick:
        args.docs, args.doc_tokens, args.questions, args.facts_per_doc = "2", 64, 2, 2
    counts = [int(x) for x in str(args.docs).split(",")]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    model_name = Path(args.model).name if args.model else DEFAULT_MODEL
    llm = LLM(model=args.model, dtype=args.dtype)
    styles = [args.style]
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if args.styles:
        styles = list(STYLES) if args.styles == "all" else args.styles.split(",")
        conditions = ["spans_off"]
    for condition in conditions:
        condition_params(condition, 1)  # raises on an unknown policy

    maker = FactMaker(llm.get_tokenizer(), args.doc_tokens, args.facts_per_doc, args.seed)
    sets = {n: make_questions(maker, n, args.questions) for n in counts}
    per_style = {}
    for style in styles:
        items = [{"n": n, "depth": depth, "set": j, "name": q["name"], "answer": q["answer"],
                  "prompt": build_prompts(llm, q, order_for(q, depth), style)}
                 for n in counts for depth in DEPTHS for j, q in enumerate(sets[n])]
        log(f"style {style!r}: {len(items)} questions x {len(conditions)} conditions "
            f"(load average {os.getloadavg()[0]:.2f})")
        max_tokens = args.max_tokens or (8 if STYLES[style][2] else 16)
        results = evaluate(llm, items, conditions, max_tokens, log)
        per_style[style] = {"items": items, "results": results, "summary": summarize(items, results)}

    for style, r in per_style.items():
        print_tables(style, r["summary"], conditions, model_name, llm, threads)
    main_style = per_style[styles[0]] if not args.styles else None
    goals = check_goals(main_style["summary"], args.doc_tokens) if main_style else {}
    if goals:
        print("\ngoals:")
        for key, g in goals.items():
            print(f"  {key}: {g['points']:+.1f} points -> {'met' if g['met'] else 'NOT met'}")
    data = {
        "benchmark": "accuracy",
        "model": model_name,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "quick": args.quick,
        "args": dict(vars(args)),
        "styles": {s: {"system": STYLES[s][0], "question": STYLES[s][1], "answer_prefix": STYLES[s][2]}
                   for s in styles},
        "machine": harness.machine_info(),
        "git": git,
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
        "elapsed_s": time.perf_counter() - started,
        "summary": {s: r["summary"] for s, r in per_style.items()},
        "goals": goals,
        "questions": {s: _records(r["items"], r["results"]) for s, r in per_style.items()},
    }
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    default_name = "accuracy-styles" if args.styles else "accuracy"
    harness.write_json(data, name=default_name, path=args.out)
    return data


def print_tables(style: str, summary: dict, conditions: list[str], model: str, llm, threads: int) -> None:
    pct = lambda v: None if v is None else f"{100 * v:.1f}"  # noqa: E731
    overall = summary["overall"]
    questions = next(iter(overall.values()))["questions"]
    base = overall.get("spans_off", {}).get("accuracy")
    headers = ["condition", "exact match %", "vs spans off (points)", "first token = full %", "number = full %",
               "output = full %"]
    rows = [[c, pct(overall[c]["accuracy"]), None if base is None else f"{100 * (overall[c]['accuracy'] - base):+.1f}",
             pct(overall[c].get("first_token_agreement")), pct(overall[c].get("answer_agreement")),
             pct(overall[c].get("output_agreement"))] for c in conditions]
    harness.print_table(headers, rows, title=f"key-value retrieval, style {style!r} ({model}, {llm.engine.dtype}, "
                                             f"{threads} threads, {questions} questions per condition)")
    cells = list(summary["cells"])
    headers = ["exact match %", *cells]
    rows = [[c, *(pct(summary["cells"][cell][c]["accuracy"]) for cell in cells)] for c in conditions]
    per_cell = summary["cells"][cells[0]][conditions[0]]["questions"]
    harness.print_table(headers, rows, title=f"per N and depth ({per_cell} questions each)")


def _records(items: list[dict], results: dict) -> list[dict]:
    out = []
    for k, item in enumerate(items):
        out.append({
            "n": item["n"], "depth": item["depth"], "set": item["set"], "name": item["name"], "answer": item["answer"],
            "prompt_tokens": len(item["prompt"]["ids"]), "spans": item["prompt"]["spans"],
            **{c: {"text": r[k]["text"], "correct": r[k]["correct"], "cached_tokens": r[k]["cached_tokens"],
                   "first_token": r[k]["token_ids"][:1]} for c, r in results.items()},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("accuracy", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
