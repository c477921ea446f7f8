"""The GPU path on one CUDA GPU: Llama-3-8B-shaped random weights in bf16 (load_format dummy).

Measured in one run, against the GPU's own roof and peers:
  matmul peak      an 8192^3 bf16 matmul (mean of 10 after 3 warm-ups): the TFLOP/s roof
  prefill          --prefill-prompts prompts of --prefill-len random tokens, chunk budget
                   --max-batched-tokens: prompt tok/s and model TFLOP/s (2 x matmul weights per
                   token + causal attention) as a fraction of the measured peak
  decode           --decode-tokens greedy tokens after a 128-token prompt, batch 1 and
                   --decode-batch: spanserve (Triton kernel + CUDA graphs), spanserve eager, and
                   transformers (same config, bf16, sdpa, its own random weights) in tok/s
  span decode      decode tok/s at batch 1 after --decode-docs documents of 1,024 tokens, as a plain
                   prompt and as warm spans in a new order
  verify step      the time of a replayed step checking k drafts (k + 1 tokens per sequence, k in
                   --verify-drafts) over 1,024 tokens of context, as a multiple of a decode step's,
                   batch 1 and --decode-batch (CUDA only): speculative decoding gains while a step's
                   accepted drafts + 1 exceed it
  span-hit TTFT    --docs documents x --doc-tokens tokens (the span-query paper's 32 x 2,857) and
                   a short question: spans off (one plain prompt, nothing cached), spans cold
                   (computed now) and spans warm in a new order (best of 3), TTFT in seconds

Random token ids, fresh for every measurement, so no prefix is cached unless the point is to.
`--shape tiny --device cpu` runs every path on a tiny model for a smoke test (the tests do so).

    spanserve bench gpu [--quick] [--shape llama3-8b|tiny] [--tokenizer DIR]
"""

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import harness

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192)),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, rope_theta=10000.0, max_position_embeddings=4096),
}
VOCAB = 32000  # token ids drawn below this: any tokenizer of the run decodes them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the default model's)")
    parser.add_argument("--prefill-prompts", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-docs", type=int, default=8, help="documents of 1,024 tokens before the span decode")
    parser.add_argument("--verify-drafts", default="2,4,8", help="drafts checked per step in the verify-step measure")
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=2857)
    parser.add_argument("--kv-cache-gb", type=float, default=30.0)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--keep-going", action="store_true",
                        help="a measurement that fails is reported as its error and the others still run")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu.json)")


def run(args: argparse.Namespace) -> dict:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = _model_dir(args)
    results: dict = {"shape": args.shape, "device": _device_name(args.device), "machine": harness.machine_info()}
    measure = _measurer(results, args.keep_going, log)
    results["matmul_peak_tflops"] = peak = measure("matmul peak", _matmul_peak, args.device) or float("nan")
    log(f"bf16 matmul peak: {peak:.0f} TFLOP/s")
    hf = None if args.no_hf else measure("transformers decode", _hf_decode, model_dir, args, log)
    _free(args.device)
    llm = _engine(model_dir, args, eager=False)
    results["prefill"] = measure("prefill", _prefill, llm, args, peak, log)
    results["decode"] = {"spanserve": measure("decode", _decode, llm, args, log)}
    results["span_ttft"] = measure("span TTFT", _span_ttft, llm, args, log)
    results["span_decode"] = measure("span decode", _span_decode, llm, args, log)
    results["verify_step"] = measure("verify step", _verify_step, llm, args, log)  # last: it writes cache blocks
    del llm
    _free(args.device)  # the eager engine's weights and cache take the graph engine's place
    results["decode"]["spanserve eager"] = measure(
        "eager decode", lambda: _decode(_engine(model_dir, args, eager=True), args, log))
    if hf is not None:
        results["decode"]["transformers"] = hf
    _report(results)
    harness.write_json(results, path=args.out or harness.result_path("gpu"))
    shutil.rmtree(model_dir, ignore_errors=True)
    return results


def _measurer(results: dict, keep_going: bool, log):
    """measure(name, fn, *fn_args) returns fn(*fn_args); with --keep-going a failure is logged and kept under
    results["errors"], it returns None and the run goes on (one call on a lent GPU should bring
    back every figure it can)."""

    def measure(name: str, fn, *fn_args):
        try:
            return fn(*fn_args)
        except Exception as exc:
            if not keep_going:
                raise
            log(f"{name} failed:\n{traceback.format_exc()}")
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            return None

    return measure


def _free(device: str) -> None:
    import torch

    gc.collect()  # engines hold reference cycles: their GPU memory goes only with a collection
    if device == "cuda":
        torch.cuda.empty_cache()


def _model_dir(args) -> Path:
    """config.json of the shape and a tokenizer, no weights (the engine makes them up)."""
    out = Path(tempfile.mkdtemp(prefix="spanserve-gpu-"))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16", **SHAPES[args.shape])
    (out / "config.json").write_text(json.dumps(config))
    source = Path(args.tokenizer) if args.tokenizer else _default_tokenizer()
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def _default_tokenizer() -> Path:
    from spanserve.models.loader import resolve_model

    return resolve_model(None)


def _engine(model_dir: Path, args, eager: bool):
    from spanserve import LLM

    return LLM(model=str(model_dir), load_format="dummy", device=args.device, dtype="bfloat16",
               kv_cache_memory_gb=args.kv_cache_gb, max_num_batched_tokens=args.max_batched_tokens,
               max_model_len=min(SHAPES[args.shape]["max_position_embeddings"],
                                 max(args.docs * args.doc_tokens, args.decode_docs * 1024) + 512, 131072),
               max_num_seqs=max(16, args.decode_batch), enforce_eager=eager)


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _matmul_peak(device: str) -> float:
    import torch

    n = 8192 if device == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - start) / 1e12


def _model_flops(shape: dict, prompt_len: int) -> float:
    """Forward FLOPs of one causal prompt (no lm_head: only its last row is computed)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    weights = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    attention = layers * 4 * shape["num_attention_heads"] * head_dim * prompt_len * (prompt_len + 1) / 2
    return 2 * weights * prompt_len + attention


def _prefill(llm, args, peak: float, log) -> dict:
    from spanserve import SamplingParams

    rng, params = random.Random(1), SamplingParams(temperature=0, max_tokens=1)
    prompts = lambda: [{"prompt_token_ids": _tokens(args.prefill_len, rng)}  # noqa: E731
                       for _ in range(args.prefill_prompts)]
    llm.generate(prompts(), params)  # warm-up: kernels compiled, allocator primed
    times = []
    for _ in range(3):
        batch = prompts()
        _sync(args.device)
        start = time.perf_counter()
        llm.generate(batch, params)
        _sync(args.device)
        times.append(time.perf_counter() - start)
    best = min(times)
    tokens = args.prefill_prompts * args.prefill_len
    tflops = args.prefill_prompts * _model_flops(SHAPES[args.shape], args.prefill_len) / best / 1e12
    log(f"prefill {args.prefill_prompts} x {args.prefill_len}: {tokens / best:,.0f} tok/s, "
        f"{tflops:.0f} TFLOP/s = {tflops / peak:.0%} of peak")
    return {"tokens": tokens, "seconds": times, "tok_per_s": tokens / best, "tflops": tflops,
            "fraction_of_peak": tflops / peak}


def _decode(llm, args, log) -> dict:
    from spanserve import SamplingParams

    rng = random.Random(2)
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    out = {}
    for batch in (1, args.decode_batch):
        llm.generate([{"prompt_token_ids": _tokens(128, rng)} for _ in range(batch)],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up and graph capture
        results = llm.generate([{"prompt_token_ids": _tokens(128, rng)} for _ in range(batch)], params)
        first = max(r.metrics.first_token_time for r in results)
        last = max(r.metrics.finish_time for r in results)
        out[f"batch {batch}"] = rate = batch * (args.decode_tokens - 1) / (last - first)
        log(f"decode batch {batch}: {rate:,.0f} tok/s")
    return out


def _hf_decode(model_dir: Path, args, log) -> dict:
    """transformers' greedy decode of the same shape: (time of N tokens - time of 1) per token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    rng, out = random.Random(3), {}

    def generate(ids, n: int) -> float:
        _sync(args.device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync(args.device)
        return time.perf_counter() - start

    for batch in (1, args.decode_batch):
        ids = torch.tensor([_tokens(128, rng) for _ in range(batch)], device=args.device)
        generate(ids, 4)  # warm-up
        rate = batch * (args.decode_tokens - 1) / (generate(ids, args.decode_tokens) - generate(ids, 1))
        out[f"batch {batch}"] = rate
        log(f"transformers decode batch {batch}: {rate:,.0f} tok/s")
    return out


def _span_ttft(llm, args, log) -> dict:
    """TTFT of one request over --docs documents: as a plain prompt, with its spans computed
    now, and with them cached and placed in a new order (best of 3 orders)."""
    from spanserve import SamplingParams

    rng = random.Random(4)
    docs = [_tokens(args.doc_tokens, rng) for _ in range(args.docs)]
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft(order: list[int], spans: bool) -> float:
        prompt = _spanned([docs[i] for i in order], rng, spans)
        _sync(args.device)
        start = time.perf_counter()
        llm.generate(prompt, params)
        _sync(args.device)
        return time.perf_counter() - start

    order = list(range(args.docs))
    off = ttft(order, spans=False)
    cold = ttft(order, spans=True)
    warm = []
    for _ in range(3):
        rng.shuffle(order)
        warm.append(ttft(order, spans=True))
    out = {"docs": args.docs, "doc_tokens": args.doc_tokens, "spans_off_s": off, "spans_cold_s": cold,
           "spans_warm_s": warm, "warm_speedup": off / min(warm)}
    log(f"span-hit TTFT at {args.docs} x {args.doc_tokens}: off {off:.2f} s, cold {cold:.2f} s, "
        f"warm {min(warm):.3f} s ({off / min(warm):.0f}x)")
    return out


def _span_decode(llm, args, log) -> dict:
    """Decode tok/s at batch 1 after --decode-docs documents of 1,024 tokens: as a plain prompt,
    and as spans cached earlier and placed in a new order (their moved keys: engine/runner.py)."""
    from spanserve import SamplingParams

    rng = random.Random(5)
    docs = [_tokens(1024, rng) for _ in range(args.decode_docs)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)

    def rate(prompt: dict) -> float:
        out = llm.generate(prompt, params)[0]
        return (args.decode_tokens - 1) / (out.metrics.finish_time - out.metrics.first_token_time)

    rate(_spanned(docs, rng, spans=True))  # caches the spans (and warms the graphs)
    plain, warm = rate(_spanned(docs, rng, spans=False)), rate(_spanned(docs[::-1], rng, spans=True))
    log(f"decode after {args.decode_docs} x 1024 tokens: plain {plain:.1f} tok/s, warm spans {warm:.1f} tok/s")
    return {"docs": args.decode_docs, "plain_tok_per_s": plain, "spans_warm_tok_per_s": warm,
            "ratio": warm / plain}


def _verify_step(llm, args, log) -> dict | None:
    """Per batch, the replayed step's time for each k as a multiple of k = 0's (a decode step).
    Its sequences write the pool's last blocks, as if their 1,024 tokens were cached there."""
    import torch

    from spanserve.attention import AttentionMetadata
    from spanserve.engine.cuda_graphs import DecodeGraphs

    if args.device != "cuda":
        return None
    engine, context, repeats = llm.engine, 1024, 50
    runner, block_size = engine.runner, engine.config.block_size
    drafts = [0] + [int(k) for k in args.verify_drafts.split(",")]
    scratch = runner.kv_cache.shape[2] - 1  # the block the runner keeps for padding rows
    out = {}
    for batch in (1, args.decode_batch):
        graphs = DecodeGraphs(runner.model, batch, engine.max_model_len, block_size, scratch, max(drafts) + 1)
        per_seq = -(-(context + max(drafts) + 1) // block_size)
        tables = torch.arange(scratch - batch * per_seq, scratch, device="cuda").view(batch, per_seq)
        times = {}
        for k in drafts:
            pos = torch.arange(context, context + k + 1, device="cuda").repeat(batch)
            seq = torch.arange(batch, device="cuda").repeat_interleave(k + 1)
            meta = AttentionMetadata(
                slot_mapping=tables[seq, pos // block_size] * block_size + pos % block_size,
                query_lens=[k + 1] * batch, context_lens=[context + k + 1] * batch, block_tables=tables,
                context_lens_tensor=torch.full((batch,), context + k + 1, dtype=torch.int32, device="cuda"),
                positions=pos)
            ids = torch.randint(100, VOCAB, (batch * (k + 1),), device="cuda")
            with torch.inference_mode():  # as the runner calls the model: the cache is an inference tensor
                graphs.run(ids, meta)  # captures
                _sync("cuda")
                start = time.perf_counter()
                for _ in range(repeats):
                    graphs.run(ids, meta)
            _sync("cuda")
            times[k] = (time.perf_counter() - start) / repeats
        out[f"batch {batch}"] = {"decode_step_ms": times[0] * 1e3,
                                 **{f"k={k}": times[k] / times[0] for k in drafts[1:]}}
        log(f"verify step batch {batch}: decode {times[0] * 1e3:.2f} ms, "
            + ", ".join(f"k={k} {times[k] / times[0]:.2f}x" for k in drafts[1:]))
        del graphs
    return out


def _spanned(docs: list[list[int]], rng: random.Random, spans: bool) -> dict:
    """A 16-token preamble, the documents (as spans, each padded to a block boundary by the
    engine's rules: 16-token multiples here) and a 32-token question; fresh preamble and question."""
    ids, intervals = _tokens(16, rng), []
    for doc in docs:
        doc = doc + [0] * (-len(doc) % 16)
        intervals.append([len(ids), len(ids) + len(doc)])
        ids = ids + doc
    prompt = {"prompt_token_ids": ids + _tokens(32, rng)}
    if spans:
        prompt["spans"] = intervals
    return prompt


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else device


def _report(results: dict) -> None:
    rows = [["bf16 matmul peak (TFLOP/s)", f"{results['matmul_peak_tflops']:.0f}"]]
    if prefill := results["prefill"]:
        rows += [["prefill tok/s", f"{prefill['tok_per_s']:,.0f}"],
                 ["prefill TFLOP/s (fraction of peak)", f"{prefill['tflops']:.0f} ({prefill['fraction_of_peak']:.0%})"]]
    rows += [[f"decode {who} {batch} (tok/s)", f"{rate:,.0f}"]
             for who, rates in results["decode"].items() for batch, rate in (rates or {}).items()]
    if span := results["span_ttft"]:
        rows += [[f"TTFT spans off, {span['docs']} x {span['doc_tokens']} (s)", f"{span['spans_off_s']:.2f}"],
                 ["TTFT spans cold (s)", f"{span['spans_cold_s']:.2f}"],
                 ["TTFT spans warm, new order (s)", f"{min(span['spans_warm_s']):.3f}"],
                 ["span-hit speedup over spans off", f"{span['warm_speedup']:.0f}x"]]
    if decode := results["span_decode"]:
        rows.append([f"decode after {decode['docs']} x 1024: plain / warm spans (tok/s)",
                     f"{decode['plain_tok_per_s']:.1f} / {decode['spans_warm_tok_per_s']:.1f}"])
    for batch, costs in (results.get("verify_step") or {}).items():
        rows.append([f"verify step {batch}: k drafts (x a {costs['decode_step_ms']:.2f} ms decode step)",
                     ", ".join(f"{k} {v:.2f}x" for k, v in costs.items() if k != "decode_step_ms")])
    rows += [[f"failed: {name}", error[:80]] for name, error in results.get("errors", {}).items()]
    harness.print_table(["measure", "value"], rows,
                        title=f"GPU path: {results['shape']} random weights, bf16, {results['device']}")


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("gpu", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
