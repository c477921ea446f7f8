"""`spanserve train comb`: train a COMB encoder plug-in by self-distillation, the decoder frozen.

For each example (comb/data.py) the model answers with the documents in full context (greedy,
spans off): that answer, and the model's whole next-token distribution along the question and
the answer, are the targets (on-policy, as the paper does). The student is the same prompt with
every document encoded alone by the plug-in (comb/dense.py, exactly what the engine computes);
the loss is KL(teacher || student) at those positions, and only the plug-in's deltas learn.

Checkpoints are judged on held-out fact lookups shaped like the benchmark's hardest cell (the
most documents, several facts each, other facts and names): the share of questions whose greedy
answer the student gives exactly as the teacher does. The KL on training-like prompts is logged
too, but it is no proxy for answers: twice it fell while the benchmark lost answers. The plug-in
written is the best checkpoint by that agreement, the starting point included.
"""

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spanserve.comb import dense
from spanserve.comb.data import SIMILAR_NAMES_HELP, ExampleMaker
from spanserve.comb.plugin import SHIPPED, CombPlugin
from spanserve.models.loader import model_name

log = logging.getLogger(__name__)


@dataclass
class Question:
    layout: dense.DenseLayout  # the student's prompt: documents as spans, then the question and answer
    positions: list[int]  # where the loss is taken: the question and the answer
    teacher: torch.Tensor  # the full-context model's log-probs there
    answer: list[int]  # the teacher's greedy answer, predicted at the last len(answer) positions
    weights: torch.Tensor  # of each position in the loss, summing to 1


def loss_weights(positions: int, answer: int, answer_share: float | None) -> torch.Tensor:
    """Every position alike (None), or `answer_share` of the weight on the answer's positions and
    the rest on the question's: the question's tokens are the user's text, whose distribution says
    little about whether the documents were read, and outnumber a short answer's several times."""
    if answer_share is None or answer in (0, positions):
        return torch.full((positions,), 1 / positions)
    question = positions - answer
    return torch.cat([torch.full((question,), (1 - answer_share) / question),
                      torch.full((answer,), answer_share / answer)])


def build(llm, maker: ExampleMaker, max_answer: int, questions: int = 1,
          answer_share: float | None = None) -> list[Question]:
    """Fresh documents and `questions` questions over them, each with its teacher targets. The
    documents are computed once for every question, by the teacher and by the student alike."""
    from spanserve import SamplingParams

    engine = llm.engine
    prompts, spans = [], None
    for example in maker.examples(questions):
        prompt = engine.chat_prompt(example.messages)
        tail = engine.tokenizer.encode(example.answer_prefix, add_special_tokens=False) if example.answer_prefix else []
        prompts.append(prompt["prompt_token_ids"] + tail)
        spans = spans or prompt["spans"]
        assert prompt["spans"] == spans and prompts[-1][:spans[-1][1]] == prompts[0][:spans[-1][1]]
    greedy = SamplingParams(temperature=0, max_tokens=max_answer)
    answers = llm.generate({"prompt_token_ids": prompts[0]}, greedy)  # then the others reuse its documents
    answers += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy) if len(prompts) > 1 else []
    full = [p + list(a.outputs[0].token_ids) for p, a in zip(prompts, answers)]
    model, first, end = engine.runner.model, spans[0][0], spans[-1][1]
    # The teacher reads the documents in context: as one span computed after the text before it, at
    # its real positions, which is the full-context forward (computed once for all the questions).
    in_context = [dense.DenseLayout(ids, [(first, end, first)], ids[:first]) for ids in full]
    out = []
    with torch.no_grad():
        documents = dense.encode_spans(model, None, in_context[0])
        for ids, teacher, prompt in zip(full, in_context, prompts):
            positions = [p for p in range(first, len(ids) - 1) if not _inside(p, spans)]
            logprobs = dense.forward(model, None, teacher, positions, documents).log_softmax(-1)
            answer = ids[len(prompt):]
            out.append(Question(dense.DenseLayout.for_engine(engine, ids, spans), positions, logprobs, answer,
                                loss_weights(len(positions), len(answer), answer_share)))
    return out


def _inside(p: int, spans) -> bool:
    return any(s <= p < e for s, e in spans)


def _student(model, plugin: CombPlugin, question: Question, encoded) -> torch.Tensor:
    """The plug-in's log-probs at the question's loss positions."""
    return dense.forward(model, plugin, question.layout, question.positions, encoded).log_softmax(-1)


def _divergence(question: Question, student: torch.Tensor) -> torch.Tensor:
    per_position = (question.teacher.exp() * (question.teacher - student)).sum(-1)
    return (per_position * question.weights.to(per_position)).sum()


def _kl(model, plugin: CombPlugin, question: Question, encoded) -> torch.Tensor:
    return _divergence(question, _student(model, plugin, question, encoded))


def kl_loss(model, plugin: CombPlugin, questions: list[Question]) -> torch.Tensor:
    """The mean KL(teacher || student) over the questions of one document set."""
    encoded = dense.encode_spans(model, plugin, questions[0].layout)
    return sum(_kl(model, plugin, q, encoded) for q in questions) / len(questions)


def train_step(model, plugin: CombPlugin, opt, questions: list[Question], lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = backward(model, plugin, questions)
    torch.nn.utils.clip_grad_norm_(plugin.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def backward(model, plugin: CombPlugin, questions: list[Question]) -> float:
    """kl_loss(...).backward(), for less memory: the encoder runs once; each question's decoder
    pass is differentiated alone into the encoder's outputs, then the encoder once for all of
    them, so memory holds one question's graph at a time. Returns the loss."""
    encoded = dense.encode_spans(model, plugin, questions[0].layout)
    outputs = [t for pair in encoded for t in pair]
    leaves = [t.detach().requires_grad_() for t in outputs]
    shared = list(zip(leaves[0::2], leaves[1::2]))
    total = 0.0
    for question in questions:
        loss = _kl(model, plugin, question, shared) / len(questions)
        loss.backward()
        total += loss.item()
    torch.autograd.backward(outputs, [t.grad for t in leaves])
    return total


@dataclass
class Validation:
    kl: float  # mean KL(teacher || student) per question
    agreement: float  # share of questions answered exactly as the teacher answers them (greedy)


def validate(model, plugin: CombPlugin, document_sets: list[list[Question]]) -> Validation:
    """The student's greedy answers are checked teacher-forced: an answer is the teacher's when at
    each of its tokens the student's argmax is that token, i.e. greedy decoding would produce it."""
    kls, agree = [], []
    with torch.no_grad():
        for questions in document_sets:
            encoded = dense.encode_spans(model, plugin, questions[0].layout)
            for q in questions:
                student = _student(model, plugin, q, encoded)
                kls.append(_divergence(q, student).item())
                picked = student[len(q.positions) - len(q.answer):].argmax(-1).tolist()
                agree.append(picked == q.answer)
    n = max(1, len(kls))
    return Validation(sum(kls) / n, sum(agree) / n)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def trainable_plugin(model, args) -> CombPlugin:
    """A fresh plug-in (or --init's), attached to the frozen model, its deltas learning in float32."""
    model.requires_grad_(False)
    if args.init:
        plugin = CombPlugin.load(Path(args.init))
        if args.reader and not plugin.has_reader:
            plugin.add_reader(model, args.seed)
    else:
        plugin = CombPlugin.zeros(model, args.rank, args.alpha, args.seed, reader=args.reader)
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
    tok = llm.get_tokenizer()
    maker = ExampleMaker(tok, seed=args.seed, min_docs=args.min_docs, max_docs=args.max_docs,
                         max_facts=args.max_facts, similar_names=args.similar_names)
    out = Path(args.out) if args.out else SHIPPED / f"{model_name(args.model).lower()}.safetensors"
    # Held out (another seed): fact lookups at the most documents, several facts in each, with the
    # training's namesakes (a run that teaches telling them apart is judged on telling them apart).
    val_docs = args.val_docs or args.max_docs
    val_maker = ExampleMaker(tok, seed=args.seed + 10_000, min_docs=val_docs, max_docs=val_docs,
                             max_facts=args.val_facts, fact_share=1.0, similar_names=args.similar_names)
    val = [build(llm, val_maker, args.max_answer, args.questions) for _ in range(args.val_examples)]
    started, history, window, done = time.monotonic(), [], [], 0
    save = lambda step: _save(plugin, out, args, history, step, started, previous)  # noqa: E731
    out_of_time = lambda: bool(args.time_limit and time.monotonic() - started > args.time_limit)  # noqa: E731
    best = _checkpoint(model, plugin, val, history, done, None, save)
    while done < args.steps and not out_of_time():
        lr = lr_at(done, args.steps, args.lr, args.warmup)
        questions = build(llm, maker, args.max_answer, args.questions, args.answer_share)
        window.append(train_step(model, plugin, opt, questions, lr))
        done += 1
        if done % args.log_every == 0:
            seconds = round(time.monotonic() - started)
            history.append({"step": done, "kl": sum(window) / len(window), "seconds": seconds})
            log.info("step %d  kl %.4f  %.0f s", done, history[-1]["kl"], seconds)
            window = []
        if done % args.save_every == 0 or done == args.steps or out_of_time():  # (the last step is judged too)
            best = _checkpoint(model, plugin, val, history, done, best, save)
    with torch.no_grad():  # the file holds the best checkpoint: write it once more with the whole curve
        for t, kept in zip(plugin.parameters(), best["state"]):
            t.copy_(kept)
    save(best["step"])
    return out


def _checkpoint(model, plugin: CombPlugin, val, history: list, step: int, best: dict | None, save) -> dict:
    """Validate; the plug-in's state becomes the best (and is saved) if it answers more held-out
    questions as the teacher does than the best so far (the lower held-out KL breaks a tie)."""
    v = validate(model, plugin, val)
    history.append({"step": step, "val_kl": v.kl, "val_agreement": v.agreement})
    log.info("step %d  held-out KL %.4f  answers as the full context %.1f%%", step, v.kl, 100 * v.agreement)
    if best is not None and (v.agreement, -v.kl) <= (best["agreement"], -best["kl"]):
        log.info("keeping step %d (%.1f%%)", best["step"], 100 * best["agreement"])
        return best
    if step:
        save(step)
    return {"step": step, "agreement": v.agreement, "kl": v.kl,
            "state": [t.detach().clone() for t in plugin.parameters()]}


def _save(plugin: CombPlugin, out: Path, args, history, steps: int, started: float, previous) -> None:
    """Write the plug-in with what made it: this run's settings and curve, and the run it continued.
    `steps`: the chosen checkpoint's (0: training never beat its start)."""
    plugin.meta = {"model": args.model, "steps": steps, "rank": plugin.rank, "lr": args.lr, "seed": args.seed,
                   "previous": previous,
                   "data": "spanserve/comb/data.py (corpus split train)", "docs": [args.min_docs, args.max_docs],
                   "facts": args.max_facts, "similar_names": args.similar_names, "questions": args.questions,
                   "answer_share": args.answer_share,
                   "reader": plugin.has_reader,
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
    p.add_argument("--reader", action="store_true", help="train reader deltas too: the decoder's query and "
                   "output projections on the tokens after the spans (added at zero to an --init plug-in)")
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-docs", type=int, default=2)
    p.add_argument("--max-docs", type=int, default=8)
    p.add_argument("--max-answer", type=int, default=24, help="teacher answer tokens per example")
    p.add_argument("--answer-share", type=float, default=None, help="share of each question's loss on its "
                   "answer's positions, the rest on the question's (default: every position alike)")
    p.add_argument("--max-facts", type=int, default=1, help="fact lookups: up to this many facts per document")
    p.add_argument("--similar-names", type=int, default=0, help=SIMILAR_NAMES_HELP)
    p.add_argument("--questions", type=int, default=4, help="questions per document set (the documents are "
                   "encoded once for all of them: more signal per step for little more time)")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: bf16 where the CPU multiplies bf16 natively, "
                   "else float32: without avx512_bf16 or AMX, bf16 matmuls are several times slower)")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-examples", type=int, default=8, help="held-out document sets, --questions each, "
                   "validated at each save")
    p.add_argument("--val-docs", type=int, default=0, help="documents per held-out set (default: --max-docs)")
    p.add_argument("--val-facts", type=int, default=3, help="facts per held-out document")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50, help="validate (and keep the best) every this many steps")


def main(argv: list[str] | None = None) -> Path:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(prog="spanserve train comb", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    out = train(args)
    print(json.dumps({"plugin": str(out)}))
    return out
