"""Sparse decode: retrieval accuracy and decode speed of every flow against full attention.

(a) Retrieval, --task multikey (RULER's MK-NIAH): a context of real prose (State of the Union
paragraphs, spanserve/corpus.py, "eval" split) of about L tokens holds --facts facts "The access
code of NAME is NNNNNN.", spread evenly; each question asks one code (the context prefix-cached, so
it is computed once), and as many contexts as --questions needs are made. --task needle (single
needle in a haystack): one haystack of about L tokens per length and, per question, one fact in it
at a depth swept evenly from the start to the end; the haystack before the needle comes from the
prefix cache, so a question costs the tokens after its needle. A question is right when its answer
holds the six digits. Greedy, same run for every condition: full attention, then each flow at
--budget tokens.
(b) Decode speed. Batch 1 and batch 8 over a multikey context (each sequence its own question), 32
tokens each, the EOS ignored: decode tokens per second, from the first token to the last.

    spanserve bench sparse [--model M] [--task needle] [--lengths 4096,8192] [--budget 2048] [--questions 100]
"""

import argparse
import random
import re
import sys
from pathlib import Path

from benchmarks import harness

SYSTEM = "You answer from the document. Reply with the number only."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--lengths", default="4096,8192", help="context lengths (tokens) of the retrieval task")
    parser.add_argument("--decode-lengths", default=None,
                        help="context lengths of the speed test (default: --lengths; '' for none)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2048, help="tokens a flow attends to per step")
    parser.add_argument("--flows", default="block_topk,quest,streaming,h2o")
    parser.add_argument("--questions", type=int, default=100, help="retrieval questions per length")
    parser.add_argument("--task", choices=("multikey", "needle"), default="multikey")
    parser.add_argument("--facts", type=int, default=10,
                        help="facts (and questions) per multikey context, as in the speed test's context")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sparse-<model>.json)")


def run(args: argparse.Namespace) -> dict:
    harness.configure_threads()
    from spanserve import LLM

    lengths = _ints(args.lengths)
    decode_lengths = _ints(args.lengths if args.decode_lengths is None else args.decode_lengths)
    flows = [f for f in args.flows.split(",") if f]
    conditions = [None, *flows]
    llm = LLM(model=args.model, kv_cache_memory_gb=6.0, max_num_seqs=32)
    accuracy, speed, answered = {}, {}, {}
    result = {"benchmark": "sparse", "model": args.model or "SmolLM2-135M-Instruct", "budget": args.budget,
              "task": args.task, "facts_per_context": 1 if args.task == "needle" else args.facts,
              "questions": args.questions if args.task == "needle" else -(-args.questions // args.facts) * args.facts,
              "accuracy": accuracy, "decode_tok_s": speed,
              "right": answered,  # per condition, each question in order: whether its answer was right
              "complete": False, "machine": harness.machine_info()}
    name = (args.model or "smollm2").lower().replace("/", "_")
    out = Path(args.out) if args.out else harness.result_path(f"sparse-{name}")
    for length in sorted(set(lengths) | set(decode_lengths)):
        if length in lengths:
            right: dict[str, list[bool]] = {_label(c): [] for c in conditions}
            for context, facts in _contexts(llm, length, args):
                prefix = llm.generate(_ask(llm, context, ""), _params(1))[0]  # the context, computed once
                log(f"{length}: a context of {len(prefix.prompt_token_ids)} tokens")
                for c in conditions:
                    right[_label(c)] += _retrieval(llm, context, facts, c, args.budget)
            accuracy[length] = {label: sum(r) / len(r) for label, r in right.items()}
            answered[length] = right
            log(f"{length}: accuracy " + ", ".join(f"{k} {v:.2f}" for k, v in accuracy[length].items()))
        if length in decode_lengths:  # over a multikey context: a question per sequence of a batch
            context, facts = _context(llm, length, args.facts, 0)
            speed[length] = {b: {_label(c): _decode_rate(llm, context, facts, b, c, args) for c in conditions}
                             for b in (int(x) for x in args.batches.split(","))}
            log(f"{length}: decode tok/s {speed[length]}")
        harness.write_json(result, path=out)  # after each length: an hour's run is not lost to a later failure
    result["complete"] = True
    harness.write_json(result, path=out)
    _report(result, [_label(c) for c in conditions])
    _plot(result, [_label(c) for c in conditions], out.with_suffix(".png"))
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _label(condition) -> str:
    return condition or "full"


def _system() -> dict:
    return {"role": "system", "content": SYSTEM}


def _params(max_tokens: int, sparse=None, budget: int = 2048, ignore_eos: bool = False):
    from spanserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, sparse=sparse, sparse_budget=budget,
                          ignore_eos=ignore_eos)


def _contexts(llm, length: int, args) -> list[tuple[str, list[tuple[str, str]]]]:
    """The task's contexts at one length, each with the facts its questions ask."""
    if args.task == "needle":
        return _needles(llm, length, args.questions)
    return [_context(llm, length, args.facts, seed) for seed in range(-(-args.questions // args.facts))]


def _context(llm, length: int, count: int, seed: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """Prose of about `length` tokens with `count` access-code facts spread evenly."""
    rng = random.Random(length * 1000 + seed)
    facts = _facts(rng, count)
    parts = _haystack(llm, length - 64 - 24 * count, rng)  # room for the chat template and the facts
    for k, fact in enumerate(facts):  # evenly, from the start to the end
        parts.insert(round(k * len(parts) / count) + k, _sentence(fact))
    return "\n".join(parts), facts


def _needles(llm, length: int, count: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """`count` copies of one haystack of about `length` tokens, copy k holding fact k alone at
    depth k / count, and the haystack alone first (its prefix, shared by every copy, cached)."""
    rng = random.Random(length * 1000 + 999)
    facts, parts = _facts(rng, count), _haystack(llm, length - 88, rng)
    needles = []
    for k, fact in enumerate(facts):
        at = round(k * len(parts) / count)
        needles.append(("\n".join([*parts[:at], _sentence(fact), *parts[at:]]), [fact]))
    return [("\n".join(parts), []), *needles]


def _facts(rng: random.Random, count: int) -> list[tuple[str, str]]:
    names = [f"{rng.choice(_FIRST)} {rng.choice(_LAST)}-{i}" for i in range(count)]
    return [(name, f"{rng.randrange(100000, 1000000)}") for name in names]


def _sentence(fact: tuple[str, str]) -> str:
    return f"The access code of {fact[0]} is {fact[1]}."


def _haystack(llm, tokens: int, rng: random.Random) -> list[str]:
    """Consecutive paragraphs of real prose, about `tokens` tokens, from a random start."""
    from spanserve.corpus import paragraphs

    tokenizer, prose = llm.get_tokenizer(), paragraphs("eval")
    parts, used, i = [], 0, rng.randrange(len(prose))
    while used < tokens:
        paragraph = prose[i % len(prose)]
        used += len(tokenizer.encode(paragraph, add_special_tokens=False)) + 1
        parts.append(paragraph)
        i += 1
    return parts


def _ask(llm, context: str, name: str) -> str:
    """The question, and the answer's start (small models otherwise restate the question first)."""
    messages = [_system(), {"role": "user", "content": f"{context}\n\nWhat is the access code of {name}?"}]
    text = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return f"{text}The access code of {name} is"


def _retrieval(llm, context: str, facts, condition, budget: int) -> list[bool]:
    """Whether each of the context's questions is answered right."""
    if not facts:
        return []
    outs = llm.generate([_ask(llm, context, name) for name, _ in facts], _params(8, condition, budget))
    return [code in re.sub(r"\D", "", out.outputs[0].text) for out, (_, code) in zip(outs, facts)]


def _decode_rate(llm, context: str, facts, batch: int, condition, args) -> float:
    """Decode tokens per second of `batch` questions decoding together (best of two runs)."""
    best = 0.0
    for _ in range(2):
        outs = llm.generate([_ask(llm, context, name) for name, _ in facts[:batch]],
                            _params(args.decode_tokens, condition, args.budget, ignore_eos=True))
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finish_time for o in outs)
        best = max(best, batch * (args.decode_tokens - 1) / (last - first))
    return best


def _report(result: dict, labels: list[str]) -> None:
    rows = [[length, *(f"{acc[label]:.2f}" for label in labels)] for length, acc in result["accuracy"].items()]
    harness.print_table(["tokens", *labels], rows, title=f"retrieval accuracy ({result['questions']} questions)")
    rows = []
    for length, batches in result["decode_tok_s"].items():
        for batch, rates in batches.items():
            full = rates["full"]
            rows.append([length, batch, f"{full:.1f}", *(f"{rates[label]:.1f} ({rates[label] / full:.2f}x)"
                                                          for label in labels[1:])])
    harness.print_table(["tokens", "batch", "full", *labels[1:]], rows, title="decode tok/s (vs full)")


def _plot(result: dict, labels: list[str], path) -> None:
    plt = harness.pyplot()
    if plt is None or not result["accuracy"] or not result["decode_tok_s"]:
        return
    length = max(set(result["accuracy"]) & set(result["decode_tok_s"]), default=None)
    if length is None:
        return
    batch = max(result["decode_tok_s"][length])
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        speedup = result["decode_tok_s"][length][batch][label] / result["decode_tok_s"][length][batch]["full"]
        ax.scatter(speedup, result["accuracy"][length][label] * 100, label=label)
    ax.set_xlabel(f"decode speed vs full attention (batch {batch}, {length} tokens)")
    ax.set_ylabel("retrieval accuracy (%)")
    ax.set_title(f"{result['model']}: sparse flows at budget {result['budget']}")
    ax.legend()
    harness.save_figure(fig, path)


_FIRST = ("Ada", "Bram", "Cleo", "Dario", "Edda", "Fenn", "Gita", "Hugo", "Ines", "Jory", "Kira", "Lars")
_LAST = ("Moss", "Nyberg", "Okafor", "Pell", "Quist", "Rowe", "Sato", "Tamm", "Ulloa", "Voss", "Wick", "Yates")


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("sparse", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
