"""`spanserve bench sparse_pick` on a tiny model: block_topk's C and torch picks, alternated."""

import json

from helpers import bench_args

from benchmarks import sparse_pick
from spanserve.kernels import cpu_kernel
from spanserve.sparse import decode as decode_module


def test_sparse_pick_bench_times_both_paths_and_they_agree(tiny_llama_path, tmp_path, monkeypatch):
    calls, native = [], cpu_kernel.centroid_topk

    def counted(*args):
        picks = native(*args)
        calls.append(picks is not None)
        return picks

    monkeypatch.setattr(cpu_kernel, "centroid_topk", counted)
    monkeypatch.setattr(decode_module, "NARROW_FROM", 2)  # the tiny model's 512 positions: narrow from 12 blocks
    out = tmp_path / "sp.json"
    sparse_pick.run(bench_args(sparse_pick, ["--model", str(tiny_llama_path), "--context", "440", "--budget", "96",
                                             "--rounds", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert set(result["paths"]) == {"c", "torch"}
    assert any(calls) and not all(calls)  # the C picks ran for one path, the torch path for the other
    assert result["same_answers"] == result["questions"] == 3
