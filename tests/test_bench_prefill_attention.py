"""`spanserve bench prefill_attention`: the C kernel and the torch path on the same chunks, timed
in turn, each with its error against a float64 softmax."""

import json

import pytest
from helpers import bench_args

from benchmarks import prefill_attention
from spanserve.attention import cpu_kernel


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")
def test_prefill_attention_bench_times_both_paths_and_checks_them(tmp_path, monkeypatch):
    monkeypatch.setattr(prefill_attention, "CASES", [("question", 6, 2, 32, 300, 5), ("prompt", 4, 4, 16, 64, 64)])
    out = tmp_path / "pa.json"
    prefill_attention.run(bench_args(prefill_attention, ["--repeats", "2", "--out", str(out)]))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["case"]) for r in rows] == [(d, c) for d in ("float32", "bfloat16")
                                                       for c in ("question", "prompt")]
    for row in rows:
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0
        assert row["kernel_error"] < (1e-4 if row["dtype"] == "float32" else 5e-2)
