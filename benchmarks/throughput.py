"""Throughput: spanserve vs HF transformers (vs llama.cpp if installed) on one model, one process.

Metrics (higher is better, tokens/s):
  prefill@512, prefill@2048  prompt tokens / time of a generate call that makes 1 token
  decode@2k b=1              (tokens - 1) / (end - first token), 64 tokens after a 2,048-token prompt
  16x128 concurrent          16 requests x 128 output tokens: ours in one generate() call,
                             the baselines one request after another; total output tokens / wall time

Both engines are loaded side by side and take turns on every repeat with the same prompts, after
a warm-up; each number is the best of its repeats (the machine is shared and noisy). Prompts are
random token ids, fresh for every run, so prefix caching cannot help. --quick (~2 minutes) makes
fewer repeats, 32 decode tokens, and times 4 of the 16 sequential baseline requests (the same
tokens/s, since they run one at a time); the full run takes ~10 minutes on 2 cores.

    python -m benchmarks.throughput [--quick] [--dtype bf16|fp32|both]
    spanserve bench throughput --quick
"""

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from benchmarks.llama_cpp_peer import LlamaCppPeer, peer_gguf

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Goal per metric: spanserve / transformers must be at least this.
GOALS = {"prefill@512": 1.0, "prefill@2048": 1.0, "decode@2k b=1": 2.0, "16x128 concurrent": 5.0}


@dataclass
class Plan:
    prefill_lens: tuple[int, ...] = (512, 2048)
    prefill_repeats: int = 3
    decode_context: int = 2048
    decode_tokens: int = 64
    decode_repeats: int = 3
    concurrent: int = 16
    concurrent_prompt: int = 128
    concurrent_tokens: int = 128
    concurrent_repeats: int = 3
    baseline_concurrent_repeats: int = 2  # the sequential baseline is slow (~1.5 min a run)
    baseline_concurrent_subset: int | None = None  # quick: time only this many of the sequential requests

    @classmethod
    def quick(cls) -> "Plan":
        return cls(prefill_repeats=2, decode_tokens=32, decode_repeats=1, concurrent_repeats=1,
                   baseline_concurrent_repeats=1, baseline_concurrent_subset=4)

    def metric_names(self) -> list[str]:
        return [f"prefill@{n}" for n in self.prefill_lens] + [
            f"decode@{self.decode_context // 1024}k b=1",
            f"{self.concurrent}x{self.concurrent_tokens} concurrent",
        ]


class Prompts:
    """Random token-id prompts; each call returns new content (so no prefix-cache hits)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.low, self.high = min(1000, vocab_size // 4), vocab_size - 1  # skip special tokens at the start

    def __call__(self, length: int) -> list[int]:
        return [self.rng.randrange(self.low, self.high) for _ in range(length)]


# ---- engines ---------------------------------------------------------------------------------
# Each runner exposes prefill(ids) -> seconds, decode(ids, n) -> (ttft_s, decode_s, tokens),
# and concurrent(prompts, n) -> (seconds, output tokens).


class SpanserveRunner:
    name = "spanserve"

    def __init__(self, model: str | None, dtype: str, max_batched_tokens: int, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", gguf_blocks: bool = True, gguf_block_activations: str = "float32"):
        from spanserve import LLM

        self.llm = LLM(model=model, dtype=dtype, max_num_batched_tokens=max_batched_tokens,
                       kv_cache_memory_gb=1.0, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                       gguf_blocks=gguf_blocks, gguf_block_activations=gguf_block_activations)
        self.vocab_size = self.llm.engine.model_config.vocab_size

    def _params(self, n: int):
        from spanserve import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def prefill(self, ids: list[int]) -> float:
        out, secs = harness.timed(lambda: self.llm.generate({"prompt_token_ids": ids}, self._params(1)))
        assert out[0].num_cached_tokens == 0, "prefill run hit the prefix cache"
        return secs

    def decode(self, ids: list[int], n: int) -> tuple[float, float, int]:
        out = self.llm.generate({"prompt_token_ids": ids}, self._params(n))[0]
        return out.metrics.ttft_s, out.metrics.e2e_s - out.metrics.ttft_s, len(out.outputs[0].token_ids)

    def concurrent(self, prompts: list[list[int]], n: int) -> tuple[float, int]:
        outs, secs = harness.timed(
            lambda: self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._params(n)))
        return secs, sum(len(o.outputs[0].token_ids) for o in outs)

    def warm_up(self, prompts: Prompts) -> None:
        self.llm.generate([{"prompt_token_ids": prompts(64)} for _ in range(4)], self._params(8))


class _TokenClock:
    """An HF streamer that only timestamps: put() gets the prompt first, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersRunner:
    name = "transformers"

    def __init__(self, path: Path, dtype: str):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
        self.vocab_size = self.model.config.vocab_size

    def _generate(self, ids: list[int], n: int, streamer=None):
        torch = self.torch
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            return self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=self.model.config.eos_token_id, streamer=streamer)

    def prefill(self, ids: list[int]) -> float:
        return harness.timed(lambda: self._generate(ids, 1))[1]

    def decode(self, ids: list[int], n: int) -> tuple[float, float, int]:
        clock = _TokenClock()
        start = time.perf_counter()
        out = self._generate(ids, n, streamer=clock)
        tokens = out.shape[1] - len(ids)
        return clock.times[1] - start, clock.times[-1] - clock.times[1], tokens

    def concurrent(self, prompts: list[list[int]], n: int) -> tuple[float, int]:
        start, tokens = time.perf_counter(), 0
        for p in prompts:  # HF generate has no continuous batching: one request after another
            tokens += self._generate(p, n).shape[1] - len(p)
        return time.perf_counter() - start, tokens

    def warm_up(self, prompts: Prompts) -> None:
        self._generate(prompts(64), 8)


class LlamaCppRunner:
    """llama.cpp on the GGUF itself (its own quantization: the dtype does not apply), in a process of
    its own (benchmarks/llama_cpp_peer.py: our OpenMP settings would slow it down 3x)."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        self.peer = LlamaCppPeer(gguf, n_ctx, threads, n_batch=2048)
        self.vocab_size = self.peer.vocab_size

    def prefill(self, ids: list[int]) -> float:
        return self.peer.prefill(ids)

    def decode(self, ids: list[int], n: int) -> tuple[float, float, int]:
        times = self.peer.token_times(ids, n)
        return times[1] - times[0], times[-1] - times[1], len(times) - 1

    def concurrent(self, prompts: list[list[int]], n: int) -> tuple[float, int]:
        start, tokens = time.perf_counter(), 0
        for p in prompts:
            tokens += len(self.peer.token_times(p, n)) - 1
        return time.perf_counter() - start, tokens

    def warm_up(self, prompts: Prompts) -> None:
        self.peer.token_times(prompts(64), 8)


# ---- measuring -------------------------------------------------------------------------------


def measure(runners: list, plan: Plan, seed: int, log) -> dict:
    """All metrics for every runner, as {engine: {metric: {...}}}.

    The runners take turns on every repeat with the same prompts, so load from other processes on a
    shared machine hits them alike instead of skewing whichever engine happened to run during it.
    """
    prompts = Prompts(min(r.vocab_size for r in runners), seed)
    for runner in runners:
        runner.warm_up(prompts)
    names = plan.metric_names()
    runs: dict[str, dict[str, list]] = {r.name: {n: [] for n in names} for r in runners}
    results: dict[str, dict] = {r.name: {} for r in runners}

    for length in plan.prefill_lens:
        for _ in range(plan.prefill_repeats):
            ids = prompts(length)
            for runner in runners:
                secs = runner.prefill(ids)
                runs[runner.name][f"prefill@{length}"].append({"seconds": secs, "tok_s": length / secs})
        for runner in runners:
            results[runner.name][f"prefill@{length}"] = _best(runs[runner.name][f"prefill@{length}"],
                                                              prompt_tokens=length)

    name = names[len(plan.prefill_lens)]
    for _ in range(plan.decode_repeats):
        # A fresh context each time: a prefix-cache hit would change the KV block layout decode reads.
        context = prompts(plan.decode_context)
        for runner in runners:
            ttft, decode_s, tokens = runner.decode(context, plan.decode_tokens)
            runs[runner.name][name].append({"ttft_s": ttft, "decode_s": decode_s, "tokens": tokens,
                                            "tok_s": (tokens - 1) / decode_s if decode_s > 0 else None})
    for runner in runners:
        results[runner.name][name] = _best(runs[runner.name][name], context_tokens=plan.decode_context)

    name = names[-1]
    for i in range(max(plan.concurrent_repeats, plan.baseline_concurrent_repeats)):
        batch = [prompts(plan.concurrent_prompt) for _ in range(plan.concurrent)]
        for runner in runners:
            ours = runner.name == "spanserve"
            if i >= (plan.concurrent_repeats if ours else plan.baseline_concurrent_repeats):
                continue
            # Sequential requests each run alone, so a subset of them gives the same tokens/s, sooner.
            todo = batch if ours or not plan.baseline_concurrent_subset else batch[: plan.baseline_concurrent_subset]
            secs, tokens = runner.concurrent(todo, plan.concurrent_tokens)
            runs[runner.name][name].append({"seconds": secs, "requests": len(todo), "output_tokens": tokens,
                                            "tok_s": tokens / secs})
    for runner in runners:
        results[runner.name][name] = _best(
            runs[runner.name][name], prompt_tokens=plan.concurrent_prompt,
            mode="one generate() call" if runner.name == "spanserve" else "one request after another")

    for name in names:
        log("  " + name + ": " + ", ".join(f"{r.name} {results[r.name][name]['tok_s']:.1f}" for r in runners)
            + " tok/s")
    return results


def _best(runs: list[dict], **extra) -> dict:
    rates = [r["tok_s"] for r in runs if r["tok_s"] is not None]
    return {"tok_s": max(rates) if rates else None, "runs": runs, **extra}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


# ---- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter decode (~2 minutes)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/throughput.json)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp (needs llama-cpp-python)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-batched-tokens", type=int, default=2048,
                        help="spanserve max_num_batched_tokens (>= 2048 keeps a 2k prefill in one chunk)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default=None, help="our weights: int8, int4 or w8a8 (default: dtype)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="our KV cache: auto (the dtype's) or bfloat16")
    parser.add_argument("--no-gguf-blocks", action="store_true",
                        help="our projections from float weights, not the GGUF's own blocks (the CPU default)")
    parser.add_argument("--gguf-block-activations", default="float32", choices=("float32", "int8"),
                        help="int8: decode's activations rounded to int8 over the GGUF's 4-bit blocks")
    parser.add_argument("--no-chart", action="store_true")


def run(args: argparse.Namespace) -> dict:
    threads = harness.configure_threads(args.threads)
    from spanserve.models.loader import DEFAULT_MODEL, resolve_model

    plan = Plan.quick() if args.quick else Plan()
    names = plan.metric_names()
    path = resolve_model(args.model)
    model_name = Path(args.model).name if args.model else DEFAULT_MODEL
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()

    llama_cpp = _llama_cpp_runner(args, plan, threads, log) if args.llama_cpp else None

    results: dict[str, dict] = {}
    block_projections: dict[str, int] = {}  # per dtype: our projections computed from the GGUF's blocks
    for dtype in dtypes:
        log(f"[{dtype}] loading")
        ours = SpanserveRunner(args.model, DTYPES[dtype], args.max_batched_tokens, args.quantization,
                               args.kv_cache_dtype, not args.no_gguf_blocks, args.gguf_block_activations)
        block_projections[dtype] = ours.llm.engine.gguf_block_projections
        runners = [ours]
        if not args.no_hf:
            runners.append(TransformersRunner(path, DTYPES[dtype]))
        if llama_cpp:
            runners.append(llama_cpp)
        log(f"[{dtype}] measuring {', '.join(r.name for r in runners)} (load average {_loadavg()})")
        results[dtype] = measure(runners, plan, args.seed, log)
        del runners
        gc.collect()

    summary = _summarize(results, names)
    for dtype in dtypes:
        columns = ["spanserve", "transformers", "ratio"] + (["llama.cpp", "vs llama.cpp"] if llama_cpp else [])
        rows = []
        for name in names:
            s = summary[dtype][name]
            row = [name, s["spanserve"], s.get("transformers"), _fmt_ratio(s.get("ratio"))]
            if llama_cpp:
                row += [s.get("llama.cpp"), _fmt_ratio(s.get("ratio_llama_cpp"))]
            rows.append(row)
        weights = args.quantization or (f"{block_projections[dtype]} projections from the GGUF's blocks"
                                        if block_projections[dtype] else "")
        kv = "" if args.kv_cache_dtype == "auto" else f", KV {args.kv_cache_dtype}"
        harness.print_table(["tokens/s", *columns], rows,
                            title=f"{dtype}{' ' + weights if weights else ''}{kv} ({model_name}, "
                                  f"{threads} threads{', quick' if args.quick else ''})")
    goals = _goals(summary, names) if not args.no_hf else {}
    if goals:
        print("\ngoals (spanserve / transformers):")
        for key, g in goals.items():
            print(f"  {key}: {_fmt_ratio(g['ratio'])} (need >= {g['need']:g}x) -> {'met' if g['met'] else 'NOT met'}")

    data = {
        "benchmark": "throughput",
        "model": model_name,
        "model_path": str(path),
        "quick": args.quick,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gguf_block_activations": args.gguf_block_activations,
        "gguf_block_projections": block_projections,
        "plan": plan.__dict__,
        "machine": harness.machine_info(),
        "elapsed_s": time.perf_counter() - started,
        "summary": summary,
        "goals": goals,
        "results": results,
    }
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    out = harness.write_json(data, name="throughput", path=args.out)
    if not args.no_chart:
        _chart(summary, names, out.with_suffix(".png"), model_name)
    return data


def _summarize(results: dict, names: list[str]) -> dict:
    summary: dict[str, dict] = {}
    for dtype, per_engine in results.items():
        summary[dtype] = {}
        for name in names:
            row = {engine: r[name]["tok_s"] for engine, r in per_engine.items()}
            row["ratio"] = _ratio(row["spanserve"], row.get("transformers"))
            if "llama.cpp" in row:
                row["ratio_llama_cpp"] = _ratio(row["spanserve"], row["llama.cpp"])
            summary[dtype][name] = row
    return summary


def _goals(summary: dict, names: list[str]) -> dict:
    goals = {}
    for dtype, rows in summary.items():
        for name, need in zip(names, GOALS.values()):
            ratio = rows[name].get("ratio")
            goals[f"{dtype} {name}"] = {"ratio": ratio, "need": need, "met": ratio is not None and ratio >= need}
    return goals


def _fmt_ratio(ratio: float | None) -> str | None:
    return None if ratio is None else f"{ratio:.2f}x"


def _chart(summary: dict, names: list[str], path: Path, model: str) -> None:
    categories, series = [], {}
    for dtype, rows in summary.items():
        for name in names:
            categories.append(f"{name}\n{dtype}")
            for engine, value in rows[name].items():
                if not engine.startswith("ratio"):
                    series.setdefault(engine, []).append(value)
    harness.bar_chart(path, f"Throughput, {model} (tokens/s, higher is better; log scale)", categories, series,
                      ylabel="tokens/s", log_scale=True)


def _llama_cpp_runner(args, plan: Plan, threads: int, log) -> LlamaCppRunner | None:
    gguf, why = peer_gguf(args.model)
    if gguf is None:
        log(f"llama.cpp: {why}; skipping its column")
        return None
    log(f"llama.cpp: {gguf.name} (its own quantization: the dtype does not apply)")
    return LlamaCppRunner(gguf, threads, n_ctx=max(*plan.prefill_lens, plan.decode_context + plan.decode_tokens) + 64)


def _loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("throughput", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
