"""Attention locality: a needle-in-a-haystack judge, flat vs the judge tree (`judge_arity=2`).

The span query paper's microbenchmark (section 6, figure 17): each of N candidates (--candidates,
default 4) holds a known name (the needle) among random filler words (the hay); a judge reads all
the candidates and must list the names. The hay grows (--hay-lengths, words before and after each
needle) and we count the runs whose answer holds every name (all found) and the mean fraction of
names found (partial credit). Two queries over the same candidates, run for run:
- flat: g(cross(system, plus(c_1, ..., c_N), question)), one judge attends to all N candidates;
- tree: the same query with `judge_arity=2`: judges over 2 candidates each, whose answers (bare) an
  outer judge reads; per judge the hay is halved, but the outer judge must merge the lists.

A candidate is a user message "<hay>\\nName <i>: <name>\\n<hay>" with hay drawn from a list of 43
lowercase words, and the question is "List the names." (greedy, --max-tokens). A name counts as
found if it occurs as a word in the root's answer; extra or invented names cost nothing. The tree
also reports what its first-level judges found together ("inner": what a perfect merge would
give). Each point runs --runs queries per variant, built from a seed, submitted to the engine
together (their calls share engine steps; the queries are independent). The engine's link policy
(--link-policy, default full: spans reused for their KV, attention as in a plain prompt) applies to
every call.

Result on SmolLM2-135M-Instruct (Q4_1, 2 shared cores, 20 runs, about 7 minutes): the tree does
NOT hold up. Flat all-found goes 60% (10 hay words), 45% (100), 0% (300), 0% (500); the tree's
root never lists all four names (0% everywhere) and its partial credit (28-39%, 12% at 500) stays
below the flat one's (85%, 74%, 41%, 26%). Attention locality does show one level down: the
first-level judges, each reading half the hay, find all names between them in 25% of the runs at
300 words where the flat judge finds them in none (66% vs 41% of the names). The loss is the merge:
this model does not stop after the names it found, it goes on listing hay words or repeating a
name, and the outer judge copies the first list with its filler up to the token limit.

What was tried on this model before settling on the above:
- candidates are fixed text, not inner `g` calls: asked to repeat a hay+needle text, the model lost
  the name in 10 of 12 runs at 40 words of hay (4 of 12 at 10 words); asked to write filler and
  then a name, it wrote the name first and repeated it, so there was no hay.
- a flat judge does the task at short hay only with keyed needles ("Name 3: Priya"), a terse
  question and link policy full; user messages beat assistant ones. Free-text needles ("The secret
  name is ..." gets one name back), few-shot examples (their names leak into the answers), sentence
  hay (copied back), digits or symbols as hay (listed back), comma-separated answers and asking to
  copy the lines verbatim all did worse. Made-up syllables as hay did as well for the flat judge at
  20 words (7 of 10 runs) but come back as invented names, and the tree was no better with them.
- given clean keyed lists ("Name 1: A\\nName 2: B" and "Name 3: C\\nName 4: D") a judge merges them
  in 10 of 12 runs, but no question made the inner judges write such lists: asked for "Name 1,
  Name 2 and the other names", the second one renumbers from 1 or invents names up to 4.
- the inner judges' lists shown to the root as assistant turns, as user turns, as one user message, or
  with "List the names above." (ad-hoc runs at 100 and 300 words): the root never listed all four
  names; a repetition penalty on every judge made flat and tree alike worse.
- link policy none (spans never attend to one another) fails even at 10 hay words; with gap 32
  (10 runs) the flat judge finds 82% of the names at 10 words (full: 84%) but all four in no run
  from 100 words on, and the tree's root is no better (0% all-found, 22-32% of the names).

    spanserve bench locality [--hay-lengths 10,100,300,500] [--runs 20] [--quick]
"""

import argparse
import random
import re
import statistics
import sys
from pathlib import Path

from benchmarks import harness
from spanserve.pic.link import POLICIES

NAMES = ["Marisol", "Thaddeus", "Ingrid", "Kofi", "Beatrix", "Osvaldo", "Yuki", "Fenwick", "Priya", "Lazlo",
         "Henrike", "Dashiell", "Noor", "Tobias", "Quentin", "Saoirse", "Rafferty", "Ottilie", "Cosimo", "Wren"]
HAY_WORDS = ("the a river stone cloud green quiet table window bread slow warm paper garden road blue small old music "
             "rain morning light cold tree water field soft yellow chair basket candle wooden bright long evening "
             "hill market glass silver quick round empty heavy").split()
SYSTEM = "You copy facts exactly."
QUESTION = "List the names."
VARIANTS = {"flat": None, "tree": 2}  # judge_arity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--hay-lengths", default="10,100,300,500", help="hay words before and after each needle")
    parser.add_argument("--candidates", type=int, default=4, help="candidates (one needle each) per judge query")
    parser.add_argument("--runs", type=int, default=20, help="queries per hay length and variant")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per judge answer")
    parser.add_argument("--link-policy", default="full", choices=POLICIES)
    parser.add_argument("--gap-length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 runs at hay lengths 5 and 20 (a smoke test)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/locality.json)")


def hay(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(HAY_WORDS) for _ in range(words))


def make_query(rng: random.Random, hay_words: int, candidates: int, max_tokens: int):
    """One judge query over `candidates` hay+needle texts; returns (tree, needles)."""
    from spanserve.spans.ir import cross, g, plus, system, user

    names = rng.sample(NAMES, candidates)
    texts = [user(f"{hay(rng, hay_words)}\nName {i + 1}: {name}\n{hay(rng, hay_words)}")
             for i, name in enumerate(names)]
    return g(cross(system(SYSTEM), plus(*texts), user(QUESTION)), max_tokens=max_tokens), names


def found(text: str, names: list[str]) -> list[str]:
    return [n for n in names if re.search(rf"\b{re.escape(n)}\b", text, re.IGNORECASE)]


def inner_found(llm, result, names: list[str], arity: int) -> list[set[str]]:
    """Names each first-level judge of a tree found among its own candidates (plus[j] reads j*arity...)."""
    tokenizer = llm.get_tokenizer()
    out = []
    for path, ids in result.outputs.items():
        if (m := re.fullmatch(r"\$\.input\.cross\[1\]\.plus\[(\d+)\]", path)):
            j = int(m.group(1))
            out.append(set(found(tokenizer.decode(ids[0]), names[j * arity:(j + 1) * arity])))
    return out


def measure(llm, hay_words: int, args, runs: int) -> dict:
    rng = random.Random(f"{args.seed}-{hay_words}")
    queries = [make_query(rng, hay_words, args.candidates, args.max_tokens) for _ in range(runs)]
    trees, needles = [q[0] for q in queries], [q[1] for q in queries]
    entry = {"hay_words": hay_words, "needles": needles}
    for variant, arity in VARIANTS.items():
        with harness.Timer() as timer:
            results = llm.run_query(trees, judge_arity=arity)
        hits = [found(r.text, names) for r, names in zip(results, needles)]
        if arity:  # what the inner judges found: all of it would reach the root if it merged their lists
            inner = [inner_found(llm, r, names, arity) for r, names in zip(results, needles)]
            entry["tree_inner"] = {
                "all_found": sum(len(set().union(*i)) == len(n) for i, n in zip(inner, needles)) / runs,
                "mean_found": statistics.fmean(len(set().union(*i)) / len(n) for i, n in zip(inner, needles)),
                "found": [[sorted(x) for x in i] for i in inner],
            }
        entry[variant] = {
            "all_found": sum(len(h) == len(n) for h, n in zip(hits, needles)) / runs,
            "mean_found": statistics.fmean(len(h) / len(n) for h, n in zip(hits, needles)),
            "calls": statistics.fmean(len(r.calls) for r in results),
            "root_prompt_tokens": statistics.fmean(r.calls[-1].prompt_tokens for r in results),
            "max_judge_prompt_tokens": max(c.prompt_tokens for r in results for c in r.calls),
            "seconds": timer.seconds,
            "answers": [r.text for r in results],
            "found": hits,
        }
    return entry


def run(args) -> dict:
    harness.configure_threads()
    from spanserve import LLM

    hay_lengths = [5, 20] if args.quick else [int(x) for x in args.hay_lengths.split(",")]
    runs = 3 if args.quick else args.runs
    llm = LLM(model=args.model, dtype=args.dtype, link_policy=args.link_policy, gap_length=args.gap_length)
    results, rows = [], []
    for hay_words in hay_lengths:
        entry = measure(llm, hay_words, args, runs)
        results.append(entry)
        flat, tree = entry["flat"], entry["tree"]
        inner = entry["tree_inner"]
        rows.append([hay_words, round(flat["root_prompt_tokens"]), round(tree["max_judge_prompt_tokens"]),
                     f"{flat['all_found']:.0%}", f"{tree['all_found']:.0%}", f"{inner['all_found']:.0%}",
                     f"{flat['mean_found']:.0%}", f"{tree['mean_found']:.0%}", f"{inner['mean_found']:.0%}",
                     f"{flat['seconds'] + tree['seconds']:.0f}"])
    headers = ["hay words", "flat prompt tok", "tree max judge tok", "flat all", "tree all", "inner all", "flat mean",
               "tree mean", "inner mean", "s"]
    harness.print_table(headers, rows, title=f"Needles found, {args.candidates} candidates, {runs} runs per point, "
                                             f"link policy {args.link_policy} (all: every name; mean: fraction)")
    data = {"benchmark": "locality", "args": vars(args), "runs": runs, "machine": harness.machine_info(),
            "results": results}
    out = harness.write_json(data, "locality", args.out)
    if not args.quick:
        chart(data, Path(out).with_suffix(".png"))
    return data


def chart(data: dict, path: Path) -> None:
    results = data["results"]
    labels = {"flat": "flat", "tree": "tree (root)", "tree_inner": "tree, first-level judges"}
    series = {f"{label} {k}": [100 * e[v][f"{k}_found"] for e in results]
              for k in ("all", "mean") for v, label in labels.items()}
    title = (f"Needles found (%), {data['args']['candidates']} candidates, flat vs judge_arity=2, "
             f"link policy {data['args']['link_policy']}")
    harness.bar_chart(path, title, [f"{e['hay_words']} hay words" for e in results], series,
                      "% of runs with all names / % of names")


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("locality", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
