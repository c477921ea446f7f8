"""`spanserve bench span_decode` on a tiny model: the three conditions run on two engines in turn."""

import json

from helpers import bench_args

from benchmarks import span_decode


def test_span_decode_bench_measures_every_condition(tiny_llama_path, tmp_path):
    out = tmp_path / "sd.json"
    span_decode.run(bench_args(span_decode, ["--model", str(tiny_llama_path), "--docs", "2", "--doc-tokens", "32",
                                             "--tokens", "4", "--repeats", "2", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert all(len(r) == 2 for r in result["runs_tok_per_s"].values())
    assert result["ratio_to_plain"]["plain"] == 1.0
    assert set(result["best_tok_per_s"]) == set(span_decode.CONDITIONS)
