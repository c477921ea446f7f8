"""spanserve train probe: pick the attention heads that vote in a COMB plug-in's focus probe.

The focus probe (engine/runner.py focus_select) recomputes in context the span blocks the
question reads most; it links the answer only if the heads it sums read by content. Which heads
do is a fact of the model (pic/voters.py), so it is measured, on training prompts: fact lookups
over 8 and 16 documents of real text (comb/data.py, corpus split "train"; never the benchmark's
facts or text), each run through the engine under link policy comb with a focus budget, the
probe's weights read from every head. A prompt counts as linked when the blocks the budget takes
(pic/focus.py) hold every token of the answer. Heads are added greedily, each time the one that
links the most training prompts (the answer's share of the chosen heads' weight breaks a tie),
while that improves. Held-out prompts (another seed) then compare the choice with the default
voters; the plug-in file gets the heads only if they link more of those.
"""

import argparse
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spanserve.comb.data import SIMILAR_NAMES_HELP, ExampleMaker, Lookup
from spanserve.comb.plugin import CombPlugin, shipped_plugin
from spanserve.pic.focus import focus_blocks, span_blocks
from spanserve.pic.link import AUTO_FOCUS_TOKENS
from spanserve.pic.voters import ProbeVoters

log = logging.getLogger(__name__)


@dataclass
class Probed:
    """One calibration prompt as the probe saw it."""
    scores: np.ndarray  # [every (layer, head), blocks]: the weight each head gives each block's span keys
    span_of_block: np.ndarray  # pic/focus.py span_blocks
    answer_blocks: set[int]  # the blocks holding the answer's tokens


def answer_positions(tok, ids: list[int], span: tuple[int, int], text: str, lookup: Lookup) -> list[int]:
    """Prompt indices of the tokens spelling the lookup's answer in its document's span, whose
    tokens spell `text` from the start."""
    first = text.index(lookup.sentence) + len(lookup.sentence) - len(lookup.value)
    last = first + len(lookup.value)
    start, end = span
    decoded = [len(tok.decode(ids[start:k])) for k in range(start + 1, end + 1)]  # text length after each token
    lo = next(k for k, n in enumerate(decoded) if n > first)
    hi = next(k for k, n in enumerate(decoded) if n >= last)
    return list(range(start + lo, start + hi + 1))


@contextmanager
def every_head_probed(runner, into: list):
    """While inside, each focus probe also reads every head of every layer: the request, their
    weights summed over the probe's rows ([(layer, head), keys]) and which keys are span keys go to
    `into`; the request runs as usual. The span keys are taken before the probe's choice moves
    the chosen ones into context: read after the request, the linked blocks would score zero."""
    cfg = runner.model.cfg
    every = ProbeVoters.of_layers(range(cfg.num_layers), cfg.num_heads)
    select = runner.focus_select

    def observe(req, link):
        span_keys = torch.from_numpy(req.layout.independent[:req.num_prompt_tokens].copy())
        into.append((req, runner.focus_weights(req, every).sum(1).cpu(), span_keys))
        return select(req, link)

    runner.focus_select = observe
    try:
        yield
    finally:
        del runner.focus_select  # the class's method again


def probe_prompts(llm, maker: ExampleMaker, count: int, docs: list[int]) -> list[Probed]:
    """`count` lookups over docs[i % len(docs)] documents, each probed with every head."""
    from spanserve import SamplingParams

    engine, tok = llm.engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1, link_policy="comb", focus_tokens=AUTO_FOCUS_TOKENS)
    out = []
    for i in range(count):
        lookup = maker.lookup(docs[i % len(docs)])
        prompt = engine.chat_prompt(lookup.example.messages)
        prefix = lookup.example.answer_prefix
        ids = prompt["prompt_token_ids"] + (tok.encode(prefix, add_special_tokens=False) if prefix else [])
        span = prompt["spans"][lookup.doc]
        answer = answer_positions(tok, ids, span, lookup.example.messages[1]["content"][lookup.doc].text, lookup)
        seen: list = []
        with every_head_probed(engine.runner, seen):
            llm.generate({"prompt_token_ids": ids, "spans": prompt["spans"]}, params)
        (req, weights, span_keys), = seen
        per_head = (weights * span_keys.float()).numpy()
        bs = engine.runner.block_size
        scores, span_of_block = span_blocks(per_head, req.layout.spans, bs)
        out.append(Probed(scores, span_of_block, {t // bs for t in answer}))
        if (i + 1) % 16 == 0:
            log.info("probed %d of %d prompts", i + 1, count)
    return out


def linked(probed: list[Probed], pairs: np.ndarray, budget_blocks: int) -> tuple[int, float]:
    """(prompts whose answer the probe links when `pairs` vote, the answer blocks' mean share of
    their weight)."""
    hits, share = 0, 0.0
    for p in probed:
        scores = p.scores[pairs].sum(0)
        hits += p.answer_blocks <= set(focus_blocks(scores, p.span_of_block, budget_blocks))
        share += scores[sorted(p.answer_blocks)].sum() / max(scores.sum(), 1e-12)
    return hits, share / len(probed)


def choose_heads(probed: list[Probed], max_heads: int, budget_blocks: int) -> list[int]:
    """Greedy forward selection of voter indices (into the probe's every-head rows)."""
    chosen: list[int] = []
    best = (-1, 0.0)
    while len(chosen) < max_heads:
        scored = [(linked(probed, np.array(chosen + [h]), budget_blocks), h)
                  for h in range(len(probed[0].scores)) if h not in chosen]
        (score, head) = max(scored, key=lambda s: s[0])
        if score[0] <= best[0] and chosen:  # no more prompts linked: stop
            break
        chosen.append(head)
        best = score
    return chosen


def calibrate(args) -> dict:
    from spanserve import LLM

    llm = LLM(model=args.model, dtype=args.dtype, comb_plugin=args.comb_plugin, num_blocks=args.num_blocks)
    runner = llm.engine.runner
    if llm.engine.comb is None:
        raise SystemExit("no COMB plug-in for this model: train one (`spanserve train comb`) or pass --comb-plugin")
    cfg, docs = runner.model.cfg, [int(n) for n in args.docs.split(",")]
    budget = -(-AUTO_FOCUS_TOKENS // runner.block_size)
    started = time.monotonic()
    tok = llm.get_tokenizer()
    train = probe_prompts(llm, ExampleMaker(tok, seed=args.seed, similar_names=args.similar_names), args.prompts, docs)
    held_out = probe_prompts(llm, ExampleMaker(tok, seed=args.seed + 10_000, similar_names=args.similar_names),
                             args.held_out, docs)
    every = ProbeVoters.of_layers(range(cfg.num_layers), cfg.num_heads).pairs
    index = {pair: i for i, pair in enumerate(every)}
    default = np.array([index[p] for p in ProbeVoters.default(cfg.num_layers, cfg.num_heads).pairs])
    chosen = choose_heads(train, args.max_heads, budget)
    rates = lambda pairs: {"train": linked(train, pairs, budget)[0] / len(train),  # noqa: E731
                           "held_out": linked(held_out, pairs, budget)[0] / len(held_out)}
    report = {"heads": [list(every[h]) for h in sorted(chosen)],
              "linked": {"default": rates(default), "chosen": rates(np.array(chosen))},
              "prompts": args.prompts, "held_out": args.held_out, "docs": docs, "seed": args.seed,
              "similar_names": args.similar_names,
              "focus_tokens": AUTO_FOCUS_TOKENS, "data": "spanserve/comb/data.py lookups (corpus split train)",
              "wall_s": round(time.monotonic() - started), "threads": torch.get_num_threads()}
    better = report["linked"]["chosen"]["held_out"] > report["linked"]["default"]["held_out"]
    report["written"] = bool(better and not args.dry_run)
    if report["written"]:
        save_heads(report, Path(args.comb_plugin) if args.comb_plugin else shipped_plugin(runner.model))
    return report


def save_heads(report: dict, path: Path) -> None:
    """Rewrite the plug-in file with the chosen heads and how they were chosen (its deltas, and so
    its span KV's hashes, unchanged)."""
    fresh = CombPlugin.load(path)  # the file's float tensors, not the engine's cast copies
    fresh.probe_heads = report["heads"]
    fresh.meta = {**fresh.meta, "probe": {k: v for k, v in report.items() if k != "written"}}
    fresh.save(path)
    log.info("wrote %d probe heads into %s", len(report["heads"]), path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, HF directory or .gguf (default: SmolLM2)")
    p.add_argument("--comb-plugin", default=None, help="plug-in file to calibrate and rewrite (default: the one "
                   "shipped for the model)")
    p.add_argument("--prompts", type=int, default=96, help="training lookups")
    p.add_argument("--held-out", type=int, default=48, help="held-out lookups (seed + 10000)")
    p.add_argument("--docs", default="8,16", help="documents per lookup, taken in turn")
    p.add_argument("--max-heads", type=int, default=8)
    p.add_argument("--similar-names", type=int, default=0, help=SIMILAR_NAMES_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="report the choice, write nothing")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-blocks", type=int, default=1024)
