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


def test_needle_task_sweeps_one_fact_through_one_haystack(tiny_llama_path, tmp_path):
    out = tmp_path / "needle.json"
    sparse.run(bench_args(sparse, ["--model", str(tiny_llama_path), "--task", "needle", "--lengths", "300",
                                   "--decode-lengths", "", "--questions", "3", "--budget", "96", "--flows",
                                   "block_topk", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert result["complete"] and (result["task"], result["questions"], result["facts_per_context"]) == ("needle", 3, 1)
    assert all(len(right) == 3 for right in result["right"]["300"].values())


def test_needles_share_the_haystack_before_each_fact():
    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    class Model:
        def get_tokenizer(self):
            return Tokenizer()

    haystack, *needles = sparse._needles(Model(), 600, 4)
    assert haystack[1] == [] and [len(facts) for _, facts in needles] == [1, 1, 1, 1]
    paragraphs = haystack[0].split("\n")
    depths = []
    for text, [fact] in needles:
        lines = text.split("\n")
        at = lines.index(sparse._sentence(fact))
        assert lines[:at] + lines[at + 1:] == paragraphs  # the haystack, the fact alone added
        depths.append(at)
    assert depths[0] == 0 and depths == sorted(depths) and depths[-1] > len(paragraphs) // 2
