"""`spanserve bench sparse` on a tiny model: every flow against full attention, both measures."""

import json

from helpers import bench_args

from benchmarks import sparse


def test_sparse_bench_measures_every_flow(tiny_llama_path, tmp_path):
    out = tmp_path / "sparse.json"
    sparse.run(bench_args(sparse, ["--model", str(tiny_llama_path), "--lengths", "400", "--questions", "4",
                                   "--facts", "2", "--budget", "96", "--batches", "1,2", "--decode-tokens", "4",
                                   "--out", str(out)]))
    result = json.loads(out.read_text())
    labels = {"full", "block_topk", "quest", "streaming", "h2o"}
    assert set(result["accuracy"]["400"]) == labels
    assert all(0 <= v <= 1 for v in result["accuracy"]["400"].values())
    assert set(result["decode_tok_s"]["400"]) == {"1", "2"}
    assert all(set(r) == labels and min(r.values()) > 0 for r in result["decode_tok_s"]["400"].values())


def test_sparse_bench_accuracy_alone(tiny_llama_path, tmp_path):
    """--decode-lengths '': accuracy only, its report and JSON without a decode table (an hour's
    30k-token run once crashed printing the empty table, before its JSON was written)."""
    out = tmp_path / "sparse.json"
    sparse.run(bench_args(sparse, ["--model", str(tiny_llama_path), "--lengths", "400", "--decode-lengths", "",
                                   "--questions", "2", "--facts", "2", "--budget", "96", "--flows", "quest",
                                   "--out", str(out)]))
    result = json.loads(out.read_text())
    assert set(result["accuracy"]["400"]) == {"full", "quest"} and result["decode_tok_s"] == {}
    for label, right in result["right"]["400"].items():  # per question, in order; the accuracy is their mean
        assert len(right) == 2 and result["accuracy"]["400"][label] == sum(right) / 2
