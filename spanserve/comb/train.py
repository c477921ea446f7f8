"""`spanserve train comb`: train a COMB encoder plug-in by self-distillation, the decoder frozen.

For each example (comb/data.py) the model answers with the documents in full context (greedy,
spans off): that answer, and the model's whole next-token distribution along the question and
the answer, are the targets (on-policy, as the paper does). The student is the same prompt with
every document encoded alone by the plug-in (comb/dense.py, exactly what the engine computes);
the loss is KL(teacher || student) at those positions, and only the plug-in's deltas learn.
"""

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from spanserve.comb import dense
from spanserve.comb.data import ExampleMaker
from spanserve.comb.plugin import SHIPPED, CombPlugin
from spanserve.models.loader import DEFAULT_MODEL

log = logging.getLogger(__name__)


def build(llm, maker: ExampleMaker, max_answer: int):
    """(DenseLayout with spans, logit positions, teacher log-probs) of one fresh example."""
    from spanserve import SamplingParams

    engine = llm.engine
    example = maker.example()
    prompt = engine.chat_prompt(example.messages)
    tail = engine.tokenizer.encode(example.answer_prefix, add_special_tokens=False) if example.answer_prefix else []
    ids = prompt["prompt_token_ids"] + tail
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_answer))[0]
    answer = list(out.outputs[0].token_ids)
    full = ids + answer
    first_span = prompt["spans"][0][0]
    positions = [p for p in range(first_span, len(full) - 1) if not _inside(p, prompt["spans"])]
    with torch.no_grad():
        teacher = dense.forward(engine.runner.model, None, dense.DenseLayout(full, [], []), positions)
    return dense.DenseLayout.for_engine(engine, full, prompt["spans"]), positions, teacher.log_softmax(-1)


def _inside(p: int, spans) -> bool:
    return any(s <= p < e for s, e in spans)


def kl_loss(model, plugin: CombPlugin, layout, positions, teacher_logprobs) -> torch.Tensor:
    student = dense.forward(model, plugin, layout, positions).log_softmax(-1)
    return (teacher_logprobs.exp() * (teacher_logprobs - student)).sum(-1).mean()


def train_step(model, plugin: CombPlugin, opt, example, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = kl_loss(model, plugin, *example)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plugin.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def validation_kl(model, plugin: CombPlugin, examples) -> float:
    with torch.no_grad():
        return sum(kl_loss(model, plugin, *example).item() for example in examples) / max(1, len(examples))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def trainable_plugin(model, args) -> CombPlugin:
    """A fresh plug-in (or --init's), attached to the frozen model, its deltas learning in float32."""
    model.requires_grad_(False)
    if args.init:
        plugin = CombPlugin.load(Path(args.init))
    else:
        plugin = CombPlugin.zeros(model, args.rank, args.alpha, args.seed)
    for t in plugin.parameters():
        t.requires_grad_(True)
    plugin.attach(model, cast=False)
    return plugin


def train(args) -> Path:
    from spanserve import LLM

    torch.manual_seed(args.seed)
    llm = LLM(model=args.model, dtype=args.dtype, num_blocks=args.num_blocks, span_anchor=True)
    model = llm.engine.runner.model
    plugin = trainable_plugin(model, args)
    previous = plugin.meta or None  # what an --init plug-in was trained with
    opt = torch.optim.AdamW(plugin.parameters(), lr=args.lr, weight_decay=0.0)
    maker = ExampleMaker(llm.get_tokenizer(), seed=args.seed, min_docs=args.min_docs, max_docs=args.max_docs)
    out = Path(args.out) if args.out else SHIPPED / f"{Path(args.model or DEFAULT_MODEL).stem.lower()}.safetensors"
    # A fixed held-out set (another seed) tracks progress: single-example losses are too noisy.
    val_maker = ExampleMaker(llm.get_tokenizer(), seed=args.seed + 10_000, min_docs=args.min_docs,
                             max_docs=args.max_docs)
    val = [build(llm, val_maker, args.max_answer) for _ in range(args.val_examples)]
    started, history, window = time.monotonic(), [], []
    log.info("held-out KL at the start: %.4f", validation_kl(model, plugin, val))
    done = 0
    while done < args.steps and not (args.time_limit and time.monotonic() - started > args.time_limit):
        lr = lr_at(done, args.steps, args.lr, args.warmup)
        window.append(train_step(model, plugin, opt, build(llm, maker, args.max_answer), lr))
        done += 1
        if done % args.log_every == 0:
            seconds = round(time.monotonic() - started)
            history.append({"step": done, "kl": sum(window) / len(window), "seconds": seconds})
            log.info("step %d  kl %.4f  %.0f s", done, history[-1]["kl"], history[-1]["seconds"])
            window = []
        if done % args.save_every == 0 or done == args.steps:
            history.append({"step": done, "val_kl": validation_kl(model, plugin, val)})
            log.info("step %d  held-out KL %.4f", done, history[-1]["val_kl"])
            _save(plugin, out, args, history, done, started, previous)
    if done % args.save_every and done < args.steps:  # stopped by the time limit
        _save(plugin, out, args, history, done, started, previous)
    return out


def _save(plugin: CombPlugin, out: Path, args, history, steps: int, started: float, previous) -> None:
    """Write the plug-in with what made it: this run's settings and curve, and the run it continued."""
    plugin.meta = {"model": args.model, "steps": steps, "rank": plugin.rank, "lr": args.lr, "seed": args.seed,
                   "previous": previous,
                   "data": "spanserve/comb/data.py (corpus split train)", "docs": [args.min_docs, args.max_docs],
                   "wall_s": round(time.monotonic() - started), "threads": torch.get_num_threads(),
                   "history": history}
    plugin.save(out)
    log.info("saved %s (%d steps)", out, steps)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, HF directory or .gguf (default: SmolLM2)")
    p.add_argument("--out", default=None, help="plug-in file (default: spanserve/comb/plugins/<model>.safetensors)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--time-limit", type=float, default=0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--init", default=None, help="continue from this plug-in (its rank and alpha win; give another "
                   "--seed so the prompts are new)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-docs", type=int, default=2)
    p.add_argument("--max-docs", type=int, default=8)
    p.add_argument("--max-answer", type=int, default=24, help="teacher answer tokens per example")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-examples", type=int, default=8, help="held-out prompts whose KL is logged at each save")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50)


def main(argv: list[str] | None = None) -> Path:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(prog="spanserve train comb", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    out = train(args)
    print(json.dumps({"plugin": str(out)}))
    return out
