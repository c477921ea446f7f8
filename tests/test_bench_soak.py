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
