"""`spanserve bench prefill_attention`: the C kernel and the torch path on the same chunks, timed
in turn, each with its error against a float64 softmax."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import bench_args

from benchmarks import prefill_attention
from spanserve.kernels import cpu_kernel


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")
def test_prefill_attention_bench_times_both_paths_and_checks_them(tmp_path, monkeypatch):
    monkeypatch.setattr(prefill_attention, "CASES", [("question", 6, 2, 32, 300, 5, 0, 0),
                                                     ("prompt", 4, 4, 16, 64, 64, 0, 0)])
    out = tmp_path / "pa.json"
    prefill_attention.run(bench_args(prefill_attention, ["--repeats", "2", "--out", str(out)]))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["case"]) for r in rows] == [(d, c) for d in ("float32", "bfloat16")
                                                       for c in ("question", "prompt")]
    for row in rows:
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0
        assert row["kernel_error"] < (1e-4 if row["dtype"] == "float32" else 5e-2)


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")
def test_prefill_attention_bench_times_an_earlier_revision_beside_it(tmp_path, monkeypatch):
    """--baseline REV builds the kernel of that revision beside today's and times it in the same
    turns (HEAD here: in a clean checkout the same sources, so the build is the cached one)."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.setattr(prefill_attention, "CASES", [("question", 6, 2, 32, 300, 5, 0, 0)])
    out = tmp_path / "pa.json"
    prefill_attention.run(bench_args(prefill_attention, ["--dtype", "float32", "--repeats", "2", "--baseline", "HEAD",
                                                         "--out", str(out)]))
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["baseline"] == "HEAD" and row["baseline_ms"] > 0 and row["over_baseline"] > 0
    assert row["baseline_error"] < 1e-4


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")
def test_rag_cases_move_the_documents_keys_and_spread_relinked_rows(tmp_path, monkeypatch):
    """A warm RAG prompt's calls: each 256-key document moved by its own distance (the kernel, the
    torch path and the float64 reference all read them moved), relinked rows spread over the
    context before the question's; --cases picks them by name."""
    monkeypatch.setattr(prefill_attention, "CASES", [("RAG relink", 6, 2, 32, 700, 5, 2, 512),
                                                     ("question", 6, 2, 32, 300, 5, 0, 0)])
    positions = prefill_attention._positions(700, 5, 2)
    assert positions.tolist() == [*range(224, 240), *range(464, 480), *range(695, 700)]
    out = tmp_path / "pa.json"
    prefill_attention.run(bench_args(prefill_attention, ["--dtype", "float32", "--repeats", "1", "--cases", "rag",
                                                         "--out", str(out)]))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "RAG relink" and row["queries"] == 37 and row["moved_keys"] == 512
    assert row["kernel_error"] < 1e-4 and row["torch_error"] < 1e-4
    rotation = prefill_attention._rotation(512, 32, 2, torch.Generator().manual_seed(0))
    assert torch.equal(rotation.half_cos[0], rotation.half_cos[255])  # one distance a document
    assert not torch.equal(rotation.half_cos[0], rotation.half_cos[256])


def test_an_unknown_baseline_revision_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="cannot read .* under spanserve/kernels/csrc/"):
        prefill_attention._baseline("no-such-revision-xyz")


@pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")
def test_layers_make_each_call_read_the_next_layers_cache(tmp_path, monkeypatch):
    """--layers N: the calls take the N caches in turn (keys out of the CPU's caches when read
    again), and the error is still checked against layer 0's softmax."""
    monkeypatch.setattr(prefill_attention, "CASES", [("question", 6, 2, 32, 300, 5, 0, 0)])
    read, kernel = [], cpu_kernel.paged_prefill

    def recording(q, k, *rest, **named):
        read.append(k.data_ptr())
        return kernel(q, k, *rest, **named)

    monkeypatch.setattr(cpu_kernel, "paged_prefill", recording)
    out = tmp_path / "pa.json"
    prefill_attention.run(bench_args(prefill_attention, ["--dtype", "float32", "--repeats", "5", "--layers", "3",
                                                         "--out", str(out)]))
    result = json.loads(out.read_text())
    assert result["layers"] == 3 and len(set(read)) == 3
    assert result["rows"][0]["kernel_error"] < 1e-4
