"""Weight-only int8 and int4 against the model's own dtype (bf16 here), same run: speed and drift.

Speed: decode tok/s at batch 1 after a --context-token random prompt (--tokens tokens, best of
--repeats) and prefill tok/s of a --prefill-token prompt. Drift, over the chat prompts below: the
greedy outputs (--answer tokens) that are identical, the mean length of the common prefix, and
the mean |logprob difference| of the first answer token (both read the same prompt).

    spanserve bench quant [--model M] [--methods int8,int4]

A method is a quantization, kv-bf16 (the KV cache in bf16: kv_cache_dtype), gguf-blocks (a GGUF's
projections computed from the file's own blocks, the CPU default: models/gguf_blocks.py), a8 (with
gguf-blocks, decode's activations rounded to int8 over 4-bit codes: gguf_block_activations), or
some of them joined by + (w8a8+kv-bf16, gguf-blocks+kv-bf16, gguf-blocks+a8). The reference computes from float
weights, and so does every method that does not name gguf-blocks.
"""

import argparse
import random
import sys

from benchmarks import harness

PROMPTS = [
    "Explain what a hash table is in two sentences.", "Write a haiku about autumn rain.",
    "What is the capital of Australia?", "List three uses of copper.", "Summarize the plot of Hamlet briefly.",
    "How do vaccines train the immune system?", "Give a Python one-liner that reverses a string.",
    "Why is the sky blue?", "Translate 'good morning' into French and Spanish.",
    "What does a compiler do?", "Suggest a name for a bakery.", "Describe the water cycle.",
    "What is 17 times 23?", "Name two differences between TCP and UDP.", "How does a bicycle stay upright?",
    "Write one sentence encouraging a student before an exam.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="int8,int4",
                        help="quantizations, kv-bf16, gguf-blocks or some joined by + (w8a8+kv-bf16), "
                             "to compare with the model's float weights")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/quant.json)")


def run(args: argparse.Namespace) -> dict:
    harness.configure_threads()
    from spanserve import LLM, SamplingParams

    methods = args.methods.split(",")
    engines = {"bf16": LLM(model=args.model, kv_cache_memory_gb=1.0, gguf_blocks=False)}
    engines.update({m: LLM(model=args.model, kv_cache_memory_gb=1.0, **engine_options(m)) for m in methods})
    vocab = engines["bf16"].engine.model_config.vocab_size
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1000, vocab - 1) for _ in range(n)]  # noqa: E731
    decode = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    speed: dict[str, dict[str, list[float]]] = {name: {"decode": [], "prefill": []} for name in engines}
    for llm in engines.values():
        llm.generate({"prompt_token_ids": tokens(64)}, SamplingParams(max_tokens=4))  # warm-up
    for _ in range(args.repeats):  # the engines take turns: noise hits all alike
        for name, llm in engines.items():
            out = llm.generate({"prompt_token_ids": tokens(args.context)}, decode)[0]
            speed[name]["decode"].append((args.tokens - 1) / (out.metrics.e2e_s - out.metrics.ttft_s))
            out = llm.generate({"prompt_token_ids": tokens(args.prefill)}, SamplingParams(max_tokens=1))[0]
            speed[name]["prefill"].append(args.prefill / out.metrics.ttft_s)
    answers = {name: llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                              SamplingParams(temperature=0, max_tokens=args.answer, logprobs=20))
               for name, llm in engines.items()}
    best = {name: {k: max(v) for k, v in runs.items()} for name, runs in speed.items()}
    result = {"benchmark": "quant", "model": args.model or "SmolLM2-135M-Instruct", "methods": methods,
              "speed_runs": speed, "best": best,
              "decode_ratio": {m: best[m]["decode"] / best["bf16"]["decode"] for m in methods},
              "prefill_ratio": {m: best[m]["prefill"] / best["bf16"]["prefill"] for m in methods},
              "drift": {m: _drift(answers["bf16"], answers[m]) for m in methods},
              "machine": harness.machine_info()}
    rows = [[f"decode tok/s after {args.context}", f"{best['bf16']['decode']:.1f}",
             *(f"{best[m]['decode']:.1f} ({result['decode_ratio'][m]:.2f}x)" for m in methods)],
            [f"prefill tok/s, {args.prefill}", f"{best['bf16']['prefill']:.0f}",
             *(f"{best[m]['prefill']:.0f} ({result['prefill_ratio'][m]:.2f}x)" for m in methods)]]
    for key, label in [("identical", "greedy answers identical"), ("mean_common_prefix", "mean common prefix"),
                       ("first_token_dlogprob", "first-token |dlogprob|")]:
        rows.append([label, "", *(_fmt(result["drift"][m][key]) for m in methods)])
    harness.print_table(["measure", "bf16", *methods], rows,
                        title=f"against the model's float weights: {result['model']} ({len(PROMPTS)} prompts, "
                              f"{args.answer}-token answers)")
    harness.write_json(result, path=args.out or harness.result_path("quant"))
    return result


def engine_options(method: str) -> dict:
    """The engine options of a method: `int8`, `kv-bf16`, `w8a8+kv-bf16`, `gguf-blocks+kv-bf16`, ..."""
    options = {}
    for part in method.split("+"):
        if part == "gguf-blocks":
            key, value = "gguf_blocks", True
        elif part == "a8":  # with gguf-blocks: decode's activations rounded to int8
            key, value = "gguf_block_activations", "int8"
        else:
            key, value = ("kv_cache_dtype", part[3:]) if part.startswith("kv-") else ("quantization", part)
        if key in options:
            sys.exit(f"method {method!r} names two of {key}")
        options[key] = value
    return {"gguf_blocks": False, **options}


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _drift(reference, other) -> dict:
    identical, prefixes, deltas = 0, [], []
    for a, b in zip(reference, other):
        x, y = a.outputs[0], b.outputs[0]
        identical += x.token_ids == y.token_ids
        common = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t),
                      min(len(x.token_ids), len(y.token_ids)))
        prefixes.append(common)
        first = x.token_ids[0]
        if first in y.logprobs[0]:
            deltas.append(abs(x.logprobs[0][first] - y.logprobs[0][first]))
    return {"prompts": len(prefixes), "identical": identical, "mean_common_prefix": sum(prefixes) / len(prefixes),
            "first_token_dlogprob": sum(deltas) / len(deltas) if deltas else float("nan")}


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("quant", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
