"""The engine's decode step and where its time goes: --batch sequences decoding after prompts of
--context random tokens (greedy, no stop), for each batch size. The step's time without a profiler
(median of --steps steps) and, from the engine's step counters over those steps (the server's
/metrics has them too), the mean time inside the model (forward pass and LM head) and the host work
around it (scheduling, inputs, sampling, detokenizing); then a cProfile of as many more steps, its
time split into projections (the quantized and packed kernels, F.linear), attention
(spanserve/attention: the C kernels or the torch path), the layer's small ops (RMSNorm, silu(gate) *
up, rotary and the cache store) and the rest (Python, scheduling, sampling, small torch ops). A C
kernel called through ctypes counts in the Python function that calls it. The profiler slows the
Python part, so the parts add up to more than the unprofiled step; their ratios are what to read.
For a bf16 model the table's title says up to how many rows its projections run in spanserve's C
GEMM (the calibrated choice, kernels/calibration.py; 0: every product in torch's F.linear) and,
where the CPU has AVX-512 BF16, which path its decode attention takes.

    spanserve bench step [--model M] [--batch 1,8] [--context 2048] [--steps 30] [--quantization w8a8]
"""

import argparse
import cProfile
import dataclasses
import pstats
import random
import statistics
import sys
import time

from benchmarks import harness

PARTS = ("projections", "attention", "layer ops", "rest")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--batch", default="1,8", help="sequences decoding together")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=30, help="steps timed, and as many profiled")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--quantization", default=None, help="int8, int4 or w8a8 (default: the dtype's weights)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/step.json)")


def run(args: argparse.Namespace) -> dict:
    threads = harness.configure_threads(args.threads)
    from spanserve import LLM

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False,
              max_model_len=args.context + 2 * args.steps + 16)
    rows = [_measure(llm, int(b), args.context, args.steps) for b in args.batch.split(",") if b]
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    result = {"benchmark": "step", "model": args.model or "SmolLM2-135M-Instruct", "dtype": dtype,
              "quantization": args.quantization, "context": args.context, "steps": args.steps, "threads": threads,
              "bf16_gemm_rows": llm.engine.bf16_gemm_rows, "rows": rows, "machine": harness.machine_info()}
    result["decode_bf16_dot"] = llm.engine.runner.decode_bf16_dot
    choice = "" if result["bf16_gemm_rows"] is None else f", C GEMM up to {result['bf16_gemm_rows']} rows"
    if result["decode_bf16_dot"] is not None:
        choice += ", decode attention " + ("dots bf16" if result["decode_bf16_dot"] else "widens bf16")
    result["gguf_block_projections"] = llm.engine.gguf_block_projections
    result["fused_layers"] = llm.engine.runner.model.fused_layers is not None
    if result["fused_layers"]:  # the profile sees one call for the layers: it counts in "rest"
        choice += ", layers in one C call (fused_layers)"
    result["prefill_bf16_dot"] = llm.engine.runner.prefill_bf16_dot
    if result["prefill_bf16_dot"] is not None:
        choice += ", prefill attention " + ("dots bf16" if result["prefill_bf16_dot"] else "widens bf16")
    harness.print_table(["batch", "step ms", "tok/s", "model ms", "host ms",
                         *[f"{p} ms (profiled)" for p in PARTS]],
                        [[r["batch"], f"{r['step_ms']:.1f}", f"{r['tok_s']:.1f}", f"{r['model_ms']:.1f}",
                          f"{r['host_ms']:.2f}", *[f"{r['profiled_ms'][p]:.1f}" for p in PARTS]] for r in rows],
                        title=f"decode step of {result['model']} ({result['dtype']}, "
                              f"{args.quantization or 'not quantized'}{choice}) after {args.context} tokens, "
                              f"{threads} threads")
    harness.write_json(result, path=args.out or harness.result_path("step"))
    return result


def _measure(llm, batch: int, context: int, steps: int) -> dict:
    """Decode `batch` sequences: `steps` steps timed, `steps` more profiled."""
    from spanserve import SamplingParams

    engine, rng = llm.engine, random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(context)]}, params)
    scheduler = engine.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in [*scheduler.running, *scheduler.waiting]):
        engine.step()
    engine.step()  # the first step with every sequence decoding, untimed
    times, counted = [], engine.step_times.totals["decode"]  # the engine adds to it in place
    before = dataclasses.replace(counted)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    counted_steps = counted.steps - before.steps
    model_ms = (counted.model_seconds - before.model_seconds) * 1000 / counted_steps
    host_ms = (counted.seconds - before.seconds) * 1000 / counted_steps - model_ms
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    while engine.has_unfinished_requests():
        engine.step()
    step_ms = statistics.median(times) * 1000
    return {"batch": batch, "step_ms": step_ms, "tok_s": batch * 1000 / step_ms, "model_ms": model_ms,
            "host_ms": host_ms, "profiled_ms": {part: ms / steps for part, ms in _parts(profile).items()}}


def _parts(profile: cProfile.Profile) -> dict[str, float]:
    """The profile's own time (ms) by part of the step."""
    parts = dict.fromkeys(PARTS, 0.0)
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profile).stats.items():
        parts[_part(path.replace("\\", "/"), name)] += own * 1000
    return parts


def _part(path: str, name: str) -> str:
    if path.endswith(("models/quant.py", "models/layout.py")) or name == "<built-in method torch._C._nn.linear>":
        return "projections"
    if "spanserve/attention/" in path or path.endswith("kernels/cpu_kernel.py"):
        return "attention"
    if path.endswith(("models/layer_ops.py", "models/triton_layer_ops.py", "models/rope.py")):
        return "layer ops"
    return "rest"


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("step", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
