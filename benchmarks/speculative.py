"""Speculative decoding by prompt lookup: decode tok/s with and without drafts, in the same run, on
answers that quote their documents, code edits and free chat, at batch 1 and batch 8, against
llama.cpp's prompt lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding, the same GGUF)
at batch 1. Greedy outputs with drafts are checked equal to those without.

Each prompt is prefilled first, by a draft model too (so the timings are decode; a draft model's
prefill of a new prompt is paid at its first decode step); the timed run generates up to
--max-tokens tokens per request, stopping at EOS as a user's request does."""

import time
from pathlib import Path

from benchmarks.harness import cli_main, machine_info, print_table, write_json

DRAFT = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CODE = Path(__file__).resolve().parents[1] / "spanserve" / "speculative" / "speculator.py"
TASKS = ("rag_quote", "code_edit", "free_chat")


def _tasks(count: int, quick: bool) -> dict[str, list[list[dict]]]:
    """`count` conversations per task (quick: short ones, for a small model's context)."""
    from spanserve.corpus import paragraphs

    prose = [p for p in paragraphs("eval") if 300 < len(p) < 900]
    code = CODE.read_text().split("\n\n\n")[1:]  # the module's top-level definitions
    rag, edit, chat = [], [], []
    for i in range(count):
        docs = prose[3 * i:3 * i + (1 if quick else 3)]
        numbered = "\n\n".join(f"Document {k + 1}:\n{d}" for k, d in enumerate(docs))
        rag.append([{"role": "user", "content": f"{numbered}\n\nQuote Document 2 exactly, word for word."}])
        snippet = code[i % len(code)][:300 if quick else None]
        edit.append([{"role": "user", "content": f"```python\n{snippet}\n```\n\nRewrite this code with every "
                                                 "comment removed; keep everything else exactly as it is."}])
        topic = ["a lighthouse", "a train journey", "a garden in winter", "a market", "a storm", "a library",
                 "an old bridge", "a fox"][i % 8]
        chat.append([{"role": "user", "content": f"Write a short original story about {topic}."}])
    return {"rag_quote": rag, "code_edit": edit, "free_chat": chat}


def _decode(llm, prompts: list[dict], max_tokens: int) -> tuple[list[list[int]], float]:
    from spanserve import SamplingParams

    # the prompts' KV cached, a draft model's too (it sees a prompt at the first decode step)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def _config(args) -> dict:
    if args.draft_model is None:
        return DRAFT
    return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k or 4}


def _run_spanserve(args, tasks) -> tuple[list[dict], dict, str]:
    """The runs, the prompts by task, and the dtype `--dtype` came to."""
    from spanserve import LLM

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, speculative_config=_config(args))
    drafting = llm.engine.speculator
    rows, prompts_by_task = [], {}
    for task, conversations in tasks.items():
        prompts = prompts_by_task[task] = [llm.engine.chat_prompt(c) for c in conversations]
        for batch in args.batches:
            group = prompts[:batch]
            for repeat in range(args.repeats):
                llm.engine.speculator = None  # the same engine without drafts (its attribute is the only switch)
                plain, plain_s = _decode(llm, group, args.max_tokens)
                llm.engine.speculator, drafting.num_drafted, drafting.num_accepted = drafting, 0, 0
                drafted, drafted_s = _decode(llm, group, args.max_tokens)
                tokens = sum(map(len, plain))
                rows.append({"task": task, "batch": batch, "repeat": repeat, "tokens": tokens,
                             "plain_tok_s": tokens / plain_s, "drafted_tok_s": sum(map(len, drafted)) / drafted_s,
                             "speedup": plain_s / drafted_s * sum(map(len, drafted)) / max(tokens, 1),
                             "acceptance": drafting.num_accepted / max(drafting.num_drafted, 1),
                             "identical": drafted == plain})
    return rows, prompts_by_task, str(llm.engine.dtype).removeprefix("torch.")


def _run_llama_cpp(args, prompts_by_task) -> list[dict]:
    from benchmarks.llama_cpp_peer import LlamaCppPeer, peer_gguf

    gguf, why = peer_gguf(args.model)
    if gguf is None:
        print(f"llama.cpp peer skipped: {why}")
        return []
    rows = []
    peers = {k: LlamaCppPeer(gguf, n_ctx=4096, threads=args.threads, prompt_lookup=k) for k in (0, DRAFT[
        "num_speculative_tokens"])}
    try:
        for task, prompts in prompts_by_task.items():
            for prompt in prompts[:1]:
                ids = prompt["prompt_token_ids"]
                result = {}
                for k, peer in peers.items():
                    peer.first_token(ids)  # its KV of the prompt
                    result[k] = min((peer.decode(ids, args.max_tokens) for _ in range(args.repeats)),
                                    key=lambda r: r[1])
                (plain, plain_s), (looked, looked_s) = result[0], result[DRAFT["num_speculative_tokens"]]
                rows.append({"task": task, "batch": 1, "plain_tok_s": len(plain) / plain_s,
                             "lookup_tok_s": len(looked) / looked_s, "identical": plain == looked})
    finally:
        for peer in peers.values():
            peer.close()
    return rows


def run(args) -> None:
    tasks = {task: prompts for task, prompts in _tasks(max(args.batches), args.quick).items() if task in args.tasks}
    rows, prompts_by_task, dtype = _run_spanserve(args, tasks)
    peer_rows = [] if args.no_peer else _run_llama_cpp(args, prompts_by_task)
    summary = {}
    for task in tasks:
        for batch in args.batches:
            mine = [r for r in rows if r["task"] == task and r["batch"] == batch]
            best = max(mine, key=lambda r: r["drafted_tok_s"])
            summary[f"{task}/b{batch}"] = {
                "plain_tok_s": max(r["plain_tok_s"] for r in mine), "drafted_tok_s": best["drafted_tok_s"],
                "speedup": max(r["drafted_tok_s"] for r in mine) / max(r["plain_tok_s"] for r in mine),
                "acceptance": best["acceptance"], "identical": all(r["identical"] for r in mine),
                **next(({"llama_cpp_tok_s": p["plain_tok_s"], "llama_cpp_lookup_tok_s": p["lookup_tok_s"]}
                        for p in peer_rows if p["task"] == task and batch == 1), {})}
    print_table(["task/batch", "plain tok/s", "drafted tok/s", "speedup", "accepted", "same tokens",
                 "llama.cpp tok/s", "llama.cpp lookup tok/s"],
                [[k, f"{v['plain_tok_s']:.1f}", f"{v['drafted_tok_s']:.1f}", f"{v['speedup']:.2f}x",
                  f"{v['acceptance']:.0%}", v["identical"], f"{v.get('llama_cpp_tok_s', 0):.1f}",
                  f"{v.get('llama_cpp_lookup_tok_s', 0):.1f}"] for k, v in summary.items()],
                title=f"speculative decoding ({_config(args)['method']}, k={_config(args)['num_speculative_tokens']}), "
                      f"{args.model or 'SmolLM2-135M-Instruct'}, {dtype}"
                      f"{', ' + args.quantization if args.quantization else ''}")
    write_json({"benchmark": "speculative", "model": args.model, "dtype": dtype,
                "quantization": args.quantization, "draft": _config(args),
                "max_tokens": args.max_tokens, "summary": summary, "runs": rows, "llama_cpp": peer_rows,
                "machine": machine_info()}, "speculative", args.out)


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 on CPUs with native bf16)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"],
                   help="spanserve's weights (docs/quantization.md); llama.cpp reads the model's GGUF as it is")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--draft-model", default=None, help="draft with this model (method draft_model) instead of ngram")
    p.add_argument("--k", type=int, default=None, help="draft_model: tokens drafted per step (default 4)")
    p.add_argument("--quick", action="store_true", help="short prompts (tests, on a tiny model)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/speculative.json)")


def main(argv: list[str] | None = None) -> int:
    return cli_main("speculative", __doc__, add_arguments, run, argv)
