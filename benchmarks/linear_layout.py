"""Float32 weights on CPU: the checkpoint's [out, in] layout against input-major (what the engine
uses, spanserve/models/layout.py), in the same run, the two taking turns.

1. GEMMs: F.linear at each of the model's projection shapes for --rows rows, best of --repeats.
2. The engine, float32, its weights relaid in place between runs: decode tok/s at batch 1 and at
   --batch (prompts of --context tokens, cached beforehand, --tokens new tokens each), and the time
   of a --question-token chunk after a cached --context-token prefix (a session's question). The
   greedy tokens of both layouts are compared (accuracy beside speed).

    spanserve bench linear_layout [--model M] [--rows 1,4,16,26,64,256] [--batch 16]
"""

import argparse
import functools
import random
import sys
import time

from benchmarks import harness

LAYOUTS = ("row_major", "input_major")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--rows", default="1,4,16,26,64,256", help="row counts of the GEMM table")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--question", type=int, default=26)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/linear_layout.json)")


def run(args: argparse.Namespace) -> dict:
    threads = harness.configure_threads(args.threads)
    from spanserve import LLM

    llm = LLM(model=args.model, dtype="float32", kv_cache_memory_gb=1.0)
    model = llm.engine.runner.model
    gemms = _gemms(model, [int(r) for r in args.rows.split(",")], args.repeats)
    engine = _engine(llm, args)
    result = {"benchmark": "linear_layout", "model": args.model or "SmolLM2-135M-Instruct", "threads": threads,
              "gemms": gemms, "engine": engine, "machine": harness.machine_info()}
    harness.print_table(["projection", "in x out", "rows", "row-major ms", "input-major ms", "speedup"],
                        [[g["projection"], f"{g['in']} x {g['out']}", g["rows"], f"{g['row_major_ms']:.3f}",
                          f"{g['input_major_ms']:.3f}", f"{g['speedup']:.2f}x"] for g in gemms],
                        title=f"float32 F.linear, {threads} threads, best of {args.repeats}")
    harness.print_table(["measure", "row-major", "input-major", "ratio"],
                        [[m["measure"], f"{m['row_major']:.1f}", f"{m['input_major']:.1f}", f"{m['ratio']:.2f}x"]
                         for m in engine["measures"]],
                        title=f"engine, float32: {result['model']}; greedy outputs identical across layouts: "
                              f"{engine['identical']} of {engine['compared']}")
    harness.write_json(result, path=args.out or harness.result_path("linear_layout"))
    return result


def _projections(model) -> dict:
    layer = model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "lm_head": model.lm_head}


def _gemms(model, row_counts: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    out = []
    for name, linear in _projections(model).items():
        weights = {"row_major": linear.weight.detach().contiguous(),
                   "input_major": linear.weight.detach().t().contiguous().t()}
        for rows in row_counts:
            x = torch.randn(rows, linear.in_features)
            best = harness.best_ms_in_turns({layout: functools.partial(F.linear, x, weights[layout])
                                             for layout in LAYOUTS}, repeats)
            out.append({"projection": name, "in": linear.in_features, "out": linear.out_features, "rows": rows,
                        "row_major_ms": best["row_major"], "input_major_ms": best["input_major"],
                        "speedup": best["row_major"] / best["input_major"]})
    return out


def _engine(llm, args) -> dict:
    from spanserve import SamplingParams
    from spanserve.models.layout import store_weights

    model = llm.engine.runner.model
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(1000, vocab - 1) for _ in range(n)]  # noqa: E731
    context = args.context // 16 * 16  # whole blocks: all of it cached
    prompts = [{"prompt_token_ids": draw(context)} for _ in range(args.batch)]
    prefix = draw(context)
    questions = {layout: [{"prompt_token_ids": prefix + draw(args.question)} for _ in range(args.repeats + 1)]
                 for layout in LAYOUTS}  # each new to the cache
    llm.generate(prompts + [{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1))  # cached from here on
    decode = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    runs = {layout: {"decode_b1": [], f"decode_b{args.batch}": [], "question_ms": []} for layout in LAYOUTS}
    outputs = {}
    for i in range(args.repeats + 1):  # the first round warms up
        for layout in LAYOUTS:
            store_weights(model, input_major=layout == "input_major")
            for key, batch in (("decode_b1", prompts[:1]), (f"decode_b{args.batch}", prompts)):
                start = time.perf_counter()
                outs = llm.generate(batch, decode)
                runs[layout][key].append(len(batch) * args.tokens / (time.perf_counter() - start))
                outputs.setdefault(layout, {})[key] = [o.outputs[0].token_ids for o in outs]
            out = llm.generate(questions[layout][i], SamplingParams(max_tokens=1))[0]
            runs[layout]["question_ms"].append(out.metrics.ttft_s * 1e3)
    store_weights(model, input_major=True)  # the engine's own layout back
    measures = []
    for key, label, better in (("decode_b1", "decode tok/s, batch 1", max),
                               (f"decode_b{args.batch}", f"decode tok/s, batch {args.batch}", max),
                               ("question_ms", f"{args.question}-token question after {context} cached, ms", min)):
        best = {layout: better(runs[layout][key][1:]) for layout in LAYOUTS}
        ratio = best["input_major"] / best["row_major"] if better is max else best["row_major"] / best["input_major"]
        measures.append({"measure": label, **best, "ratio": ratio})
    pairs = [(a, b) for key in outputs["row_major"]
             for a, b in zip(outputs["row_major"][key], outputs["input_major"][key])]
    return {"context": context, "tokens": args.tokens, "batch": args.batch, "question": args.question,
            "runs": runs, "measures": measures, "compared": len(pairs), "identical": sum(a == b for a, b in pairs)}


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("linear_layout", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
