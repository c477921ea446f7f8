"""The RAG benchmark (benchmarks/rag.py) runs end to end on a tiny random model and reports every
condition in the documented shape (the accuracy benchmark: test_bench_accuracy.py)."""

import json

import pytest
from helpers import bench_args

from benchmarks import rag


@pytest.fixture(scope="module")
def rag_result(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("rag") / "rag.json"
    args = bench_args(rag, ["--model", str(tiny_llama_path), "--dtype", "float32", "--docs", "1,3",
                            "--doc-tokens", "40", "--repeats", "2", "--answer-tokens", "4",
                            "--link-policies", "none,gap32,default", "--out", str(out)])
    return rag.run(args), out


def test_rag_reports_every_condition_with_positive_times(rag_result):
    data, out = rag_result
    assert set(data["summary"]) == {1, 3}
    conditions = ["spans_off_cold", "spans_off_warm_shuffled", "spans_cold[none]", "spans_warm_shuffled[none]",
                  "spans_cold[gap32]", "spans_warm_shuffled[gap32]", "spans_warm_shuffled[default]"]
    for n, summary in data["summary"].items():
        for condition in conditions:
            assert summary[condition] > 0, (n, condition)
            runs = data["results"][n]["runs"][condition]
            assert len(runs) == 2 and all(r["ttft_s"] > 0 and r["wall_s"] >= r["ttft_s"] for r in runs)
        assert summary["prompt_tokens"] > 3 * 30 if n == 3 else summary["prompt_tokens"] > 30
        assert summary["off_warm/spans_warm[none]"] > 0
    assert out.exists() and out.with_suffix(".png").exists()
    assert json.loads(out.read_text())["benchmark"] == "rag"


def test_rag_reuses_cached_spans_for_shuffled_documents(rag_result):
    data, _ = rag_result
    runs = data["results"][3]["runs"]
    for cold, warm in zip(runs["spans_cold[none]"], runs["spans_warm_shuffled[none]"]):
        assert warm["order"] != cold["order"]
        assert cold["cached_tokens"] < warm["cached_tokens"]  # only the system prompt was cached when cold
    # Without spans a reordered prompt shares only the text before the first document.
    off = runs["spans_off_warm_shuffled"][0]
    assert off["cached_tokens"] < runs["spans_warm_shuffled[none]"][0]["cached_tokens"]


def test_rag_records_answers_per_condition(rag_result):
    data, _ = rag_result
    answers = data["results"][3]["answers"]
    assert answers["expected"] and answers["question"].startswith("What is the capital of")
    assert {"spans_off", "spans[none]", "spans[gap32]"} <= set(answers)


def test_rag_documents_are_distinct_and_sized(tiny_llama_path):
    from spanserve.models.loader import load_tokenizer

    maker = rag.DocumentMaker(load_tokenizer(tiny_llama_path), 120, seed=3)
    docs = maker.documents(5)
    assert len({d["text"] for d in docs}) == 5 and len({d["place"] for d in docs}) == 5
    for d in docs:
        assert 60 < maker.count(d["text"]) <= 120
        assert f"The capital of {d['place']} is {d['capital']}." in d["text"]


def test_the_rag_record_names_the_modified_files_whole(monkeypatch):
    """git status --porcelain lines start with a space for a file changed but not staged: the
    record keeps every path whole, the first one too."""
    import subprocess

    out = {"rev-parse": "abc123\n", "status": " M benchmarks/rag.py\n M spanserve/llm.py\n"}
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, out[cmd[1]], ""))
    state = rag.git_state()
    assert state["commit"] == "abc123"
    assert state["modified"] == ["benchmarks/rag.py", "spanserve/llm.py"]
