"""The span query benchmarks run end to end on a tiny model and report what they promise."""

import argparse

from benchmarks import nested


def test_nested_benchmark_reports_both_modes(tiny_llama_path, tmp_path):
    parser = argparse.ArgumentParser()
    nested.add_arguments(parser)
    out = tmp_path / "nested.json"
    args = parser.parse_args(["--quick", "--model", str(tiny_llama_path), "--dtype", "float32", "--out", str(out),
                              "--temperatures", "0.5"])
    data = nested.run(args)
    assert out.exists() and [e["fanout"] for e in data["results"]] == [1, 2]
    for entry in data["results"]:
        span, plain = entry["span query"], entry["plain"]
        assert span["judge_ttft_s"] > 0 and plain["judge_ttft_s"] > 0
        assert span["judge_cached_tokens"] >= 16 * entry["fanout"]  # every candidate span reused
        assert plain["judge_cached_tokens"] < span["judge_cached_tokens"]
