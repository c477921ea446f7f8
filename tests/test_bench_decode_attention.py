"""`spanserve bench decode_attention`: the C kernel and the torch path on the same decode steps,
timed in turn, each with its error against a float64 softmax."""

import json
import subprocess
from pathlib import Path

import pytest
from helpers import bench_args

from benchmarks import decode_attention
from spanserve.kernels import cpu_kernel

needs_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")
SMALL = [("one long", 6, 2, 32, 1, 300), ("a batch", 4, 4, 16, 3, 70)]


@needs_kernel
def test_decode_attention_bench_times_both_paths_and_checks_them(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_attention, "CASES", SMALL)
    out = tmp_path / "da.json"
    decode_attention.run(bench_args(decode_attention, ["--dtype", "both", "--repeats", "2", "--layers", "2",
                                                       "--out", str(out)]))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["case"]) for r in rows] == [(d, c) for d in ("float32", "bfloat16")
                                                       for c in ("one long", "a batch")]
    for row in rows:
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0 and row["kernel_gb_s"] > 0
        tolerance = 1e-4 if row["dtype"] == "float32" else 5e-2
        assert row["kernel_error"] < tolerance and row["torch_error"] < tolerance


@needs_kernel
def test_each_call_reads_the_next_layers_cache(tmp_path, monkeypatch):
    """--layers N: the calls take the N caches in turn, and the error is checked on layer 0's."""
    monkeypatch.setattr(decode_attention, "CASES", SMALL[:1])
    read, kernel = [], cpu_kernel.paged_decode

    def recording(q, k, *rest):
        read.append(k.data_ptr())
        return kernel(q, k, *rest)

    monkeypatch.setattr(cpu_kernel, "paged_decode", recording)
    out = tmp_path / "da.json"
    decode_attention.run(bench_args(decode_attention, ["--repeats", "5", "--layers", "3", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert result["layers"] == 3 and len(set(read)) == 3
    assert result["rows"][0]["kernel_error"] < 1e-4


@needs_kernel
def test_decode_attention_bench_times_an_earlier_revision_beside_it(tmp_path, monkeypatch):
    """--baseline REV: that revision's kernels built beside today's, in the same turns."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.setattr(decode_attention, "CASES", SMALL[1:])
    out = tmp_path / "da.json"
    decode_attention.run(bench_args(decode_attention, ["--repeats", "2", "--layers", "1", "--baseline", "HEAD",
                                                       "--out", str(out)]))
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["baseline"] == "HEAD" and row["baseline_ms"] > 0 and row["baseline_error"] < 1e-4
