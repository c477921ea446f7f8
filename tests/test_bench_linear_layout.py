"""`spanserve bench linear_layout`: both layouts timed in turn, GEMMs and engine, and the engine's
greedy outputs compared across them."""

import json

from helpers import bench_args

from benchmarks import linear_layout


def test_linear_layout_bench_times_both_layouts_and_compares_outputs(tiny_llama_path, tmp_path):
    out = tmp_path / "ll.json"
    linear_layout.run(bench_args(linear_layout, ["--model", str(tiny_llama_path), "--rows", "1,16", "--batch", "3",
                                                 "--context", "40", "--tokens", "3", "--question", "5",
                                                 "--repeats", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    gemms = result["gemms"]
    assert [(g["projection"], g["rows"]) for g in gemms] == [(p, r) for p in ("qkv", "o", "gate_up", "down", "lm_head")
                                                             for r in (1, 16)]
    assert all(g["row_major_ms"] > 0 and g["input_major_ms"] > 0 for g in gemms)
    engine = result["engine"]
    assert [m["measure"].split(",")[0] for m in engine["measures"]][:2] == ["decode tok/s"] * 2
    assert all(m["row_major"] > 0 and m["input_major"] > 0 for m in engine["measures"])
    assert engine["compared"] == 4 and engine["identical"] == 4  # batch 1 and batch 3, greedy
