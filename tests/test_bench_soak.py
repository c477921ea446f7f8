"""`spanserve bench soak`, a few seconds of it on a tiny model: every kind of client runs, nothing
is a 5xx, and the KV blocks in use come back to the baseline."""

import json

from helpers import bench_args

from benchmarks import soak


def test_a_short_soak_has_no_errors_and_frees_every_block(tiny_llama_path, tmp_path):
    out = tmp_path / "soak.json"
    args = bench_args(soak, ["--model", str(tiny_llama_path), "--clients", "6", "--minutes", "0.15",
                             "--sample-s", "1", "--max-tokens", "8", "--out", str(out), "--no-chart",
                             "--serve-args", "--dtype float32 --num-blocks 1024"])
    soak.run(args)
    result = json.loads(out.read_text())
    assert all(s["requests"] > 0 and s["errors"] == 0 for s in result["per_kind"].values()), result["per_kind"]
    assert result["kv_blocks_back_to_baseline"]
    # a client gives up on each abandoned request; one the server finished sooner is a 200, not an error
    abandoned = result["per_kind"]["abandoned"]["statuses"]
    assert abandoned.get("0", 0) > 0 and set(abandoned) <= {"0", "200"}, abandoned


def test_a_soak_with_a_session_tenant_reports_the_stateless_tenants_cost(tiny_llama_path, tmp_path):
    """Two phases: the stateless tenant alone, then beside a tenant running sessions near their
    limits; no 5xx for either tenant in either, and the p99 ratios reported."""
    out = tmp_path / "soak.json"
    args = bench_args(soak, ["--model", str(tiny_llama_path), "--clients", "4", "--minutes", "0.1",
                             "--sample-s", "1", "--max-tokens", "8", "--out", str(out), "--no-chart",
                             "--session-clients", "2", "--serve-args", "--dtype float32 --num-blocks 1024"])
    soak.run(args)
    result = json.loads(out.read_text())
    for phase, kinds in result["phases"].items():
        assert all(s["errors"] == 0 for s in kinds.values()), (phase, kinds)
    with_sessions = result["phases"]["with_sessions"]
    assert with_sessions["session_append"]["requests"] > 1 and with_sessions["session_query"]["requests"] > 0
    assert result["phases"]["alone"]["session_append"]["requests"] == 0
    assert set(result["p99_with_sessions_over_alone"]) == set(soak.KINDS)
    assert result["kv_blocks_back_to_baseline"]
