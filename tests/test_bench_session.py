"""`spanserve bench session` on a tiny model: every path measured at every step, same tokens."""

import json

from helpers import bench_args

from benchmarks import session


def test_session_bench_measures_every_path(tiny_llama_path, tmp_path):
    out = tmp_path / "s.json"
    session.run(bench_args(session, ["--model", str(tiny_llama_path), "--max-context", "400", "--steps", "2",
                                     "--window-questions", "2", "--sparse", "block_topk", "--sparse-budget", "96",
                                     "--quantization", "int8", "--repeats", "2", "--background-chunk-tokens", "16",
                                     "--out", str(out)]))
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert (result["quantization"], result["sparse"], result["repeats"]) == ("int8", "block_topk", 2)  # what ran
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert steps[0]["context_tokens"] < steps[1]["context_tokens"] < steps[2]["context_tokens"]
    for s in steps:
        assert s["session_ms"] > 0 and s["stateless_ms"] > 0 and s["stateless_cached_ms"] > 0
        assert s["flash_hit_ms"] < s["session_ms"]  # a kept answer, no forward pass
    assert steps[2]["while_ingesting_ms"] > 0 and steps[2]["while_ingesting_unstopped_ms"] > 0
    assert steps[2]["ingest_tok_s"] > 0
    assert steps[2]["window_evicted"] > 0  # the rolling window dropped data
    assert result["summary"]["stateless / session at the end"] > 0
    for s in steps:  # --sparse: the session asked over the flow's blocks too, its answers compared
        assert s["session_sparse_ms"] > 0 and 0 <= s["sparse_agree"] <= 1 and 0 <= s["window_full_sparse"] <= 1
        assert round(s["sparse_agree"] * 6, 6).is_integer()  # of the 3 questions asked twice
    assert 0 <= result["summary"]["sparse session answers = dense session's"] <= 1
    for s in steps:  # the speculative-exit check: an exit is a kept token, else a computed answer
        assert s["trend"] in ("UP", "DOWN") and s["exit"] == (s["exit_ms"] is not None)
        assert not s["exit"] or s["exit_answer"] in ("UP", "DOWN")
    assert 0 <= result["summary"]["speculative exit rate"] <= 1
