"""`spanserve bench gpu` end to end on a tiny shape on the CPU: every measurement runs and lands
in the JSON (the real run needs a GPU: benchmarks/results/gpu-h100.json)."""

import json

from helpers import bench_args

from benchmarks import gpu


def test_tiny_gpu_bench_runs_every_measurement_on_cpu(tmp_path, tokenizer_dir):
    out = tmp_path / "gpu.json"
    args = bench_args(gpu, ["--shape", "tiny", "--device", "cpu", "--tokenizer", str(tokenizer_dir),
                            "--docs", "3", "--doc-tokens", "40", "--prefill-len", "64", "--decode-tokens", "4",
                            "--decode-batch", "2", "--decode-docs", "2", "--kv-cache-gb", "0.05", "--out", str(out)])
    gpu.run(args)
    result = json.loads(out.read_text())
    assert set(result["decode"]) == {"spanserve", "spanserve eager", "transformers"}
    assert all(set(rates) == {"batch 1", "batch 2"} for rates in result["decode"].values())
    span = result["span_ttft"]
    assert span["docs"] == 3 and len(span["spans_warm_s"]) == 3
    assert span["warm_speedup"] == span["spans_off_s"] / min(span["spans_warm_s"])
    assert result["prefill"]["tokens"] == 2 * 64
    decode = result["span_decode"]
    assert decode["docs"] == 2 and decode["ratio"] == decode["spans_warm_tok_per_s"] / decode["plain_tok_per_s"]
