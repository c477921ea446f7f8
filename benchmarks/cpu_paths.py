"""The per-CPU path choices of a bf16 model (kernels/calibration.py) against torch's paths, one
engine taking turns: speed and drift.

"torch" runs every projection in torch's F.linear (oneDNN) and decode attention over bf16 keys
as dot products where the CPU has AVX-512 BF16: the engine before the calibration existed.
"chosen" runs what the calibration measured fastest here, and a decode step's layers in one C
call where every projection computes from a GGUF's blocks (models/fused_layers.py). Speed: decode
tok/s of --batch sequences after --context random tokens (--tokens each, best of --repeats). Drift, over the chat
prompts of `bench quant`: greedy answers identical, mean common prefix, mean |logprob
difference| of the first answer token, between the two, and of each against the same model in
float32 (which of the two bf16 roundings stays closer to it).

    spanserve bench cpu_paths [--model M] [--batch 1,8] [--context 1024]
"""

import argparse
import random
import sys
from contextlib import contextmanager, nullcontext

from benchmarks import harness
from benchmarks.quant import PROMPTS, _drift, _fmt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu_paths.json)")


def run(args: argparse.Namespace) -> dict:
    threads = harness.configure_threads(args.threads)
    from spanserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", kv_cache_memory_gb=1.0)
    engine = llm.engine
    modes = {"torch": _torch_paths, "chosen": nullcontext}
    rng = random.Random(0)
    batches = [int(b) for b in args.batch.split(",") if b]
    decode = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    speed: dict[str, dict[str, list[float]]] = {m: {f"batch {b}": [] for b in batches} for m in modes}
    llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=4))  # warm-up
    for _ in range(args.repeats):  # the modes take turns: noise hits both alike
        for batch in batches:
            prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(args.context)]}
                       for _ in range(batch)]
            for mode, paths in modes.items():
                with paths(engine):
                    outs = llm.generate(prompts, decode)
                first = max(o.metrics.first_token_time for o in outs)  # every sequence decoding from here
                last = max(o.metrics.finish_time for o in outs)
                speed[mode][f"batch {batch}"].append(batch * (args.tokens - 1) / (last - first))
    chat = [[{"role": "user", "content": p}] for p in PROMPTS]
    answers = {}
    for mode, paths in modes.items():
        with paths(engine):
            answers[mode] = llm.chat(chat, SamplingParams(temperature=0, max_tokens=args.answer, logprobs=20))
    reference = LLM(model=args.model, dtype="float32", kv_cache_memory_gb=1.0).chat(
        chat, SamplingParams(temperature=0, max_tokens=args.answer, logprobs=20))
    best = {m: {k: max(v) for k, v in runs.items()} for m, runs in speed.items()}
    fused = engine.runner.model.fused_layers is not None
    result = {"benchmark": "cpu_paths", "model": args.model or "SmolLM2-135M-Instruct", "threads": threads,
              "context": args.context, "bf16_gemm_rows": engine.bf16_gemm_rows,
              "decode_bf16_dot": engine.runner.decode_bf16_dot, "fused_decode": fused,
              "speed_runs": speed, "best": best,
              "drift": _drift(answers["torch"], answers["chosen"]),
              "drift_vs_float32": {m: _drift(reference, answers[m]) for m in modes}, "machine": harness.machine_info()}
    rows = [[f"decode tok/s, {key}, after {args.context}", f"{best['torch'][key]:.1f}",
             f"{best['chosen'][key]:.1f} ({best['chosen'][key] / best['torch'][key]:.2f}x)"] for key in best["torch"]]
    for key, label in [("identical", f"greedy answers identical of {len(PROMPTS)}"),
                       ("mean_common_prefix", "mean common prefix"),
                       ("first_token_dlogprob", "first-token |dlogprob|")]:
        rows.append([f"{label}: torch vs chosen", "", _fmt(result["drift"][key])])
        rows.append([f"{label}: against float32", *(_fmt(result["drift_vs_float32"][m][key]) for m in modes)])
    harness.print_table(["measure", "torch", "chosen"], rows,
                        title=f"{result['model']} bf16, {threads} threads: C GEMM up to {engine.bf16_gemm_rows} rows, "
                              f"bf16 decode dot products {engine.runner.decode_bf16_dot}"
                              + (", decode layers in one C call" if fused else ""))
    harness.write_json(result, path=args.out or harness.result_path("cpu_paths"))
    return result


@contextmanager
def _torch_paths(engine):
    from spanserve.kernels import cpu_kernel

    kernel = cpu_kernel.load()
    with cpu_kernel.only_kernels(set(cpu_kernel.KERNELS) - {"gemm"}):
        if kernel is not None:
            kernel.set_bf16_dot(1)
            kernel.set_prefill_bf16_dot(0)  # prefill attention widened to float32, as before its dot products
        try:
            yield
        finally:
            if kernel is not None and engine.runner.decode_bf16_dot is not None:
                kernel.set_bf16_dot(int(engine.runner.decode_bf16_dot))
            if kernel is not None and engine.runner.prefill_bf16_dot is not None:
                kernel.set_prefill_bf16_dot(int(engine.runner.prefill_bf16_dot))


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("cpu_paths", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
