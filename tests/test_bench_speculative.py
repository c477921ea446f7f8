"""`spanserve bench speculative` runs end to end on a tiny model and writes its JSON (no timing is
checked): drafted greedy outputs equal the plain ones in every run."""

import json

from benchmarks import speculative


def test_the_benchmark_runs_and_checks_its_outputs(tiny_llama_path, tmp_path):
    out = tmp_path / "speculative.json"
    speculative.main(["--model", str(tiny_llama_path), "--batches", "1", "2", "--max-tokens", "12",
                      "--repeats", "1", "--no-peer", "--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {f"{task}/b{b}" for task in ("rag_quote", "code_edit", "free_chat")
                                      for b in (1, 2)}
    assert all(run["identical"] and run["tokens"] > 0 for run in result["runs"])
    assert all(0 <= s["acceptance"] <= 1 and s["plain_tok_s"] > 0 for s in result["summary"].values())
