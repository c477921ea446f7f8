"""`spanserve bench session_server` on a tiny model: questions over HTTP, idle and while the
session ingests, every one answered, and the report's figures consistent with them."""

import json

from helpers import bench_args

from benchmarks import session_server


def test_session_questions_over_http_during_ingest(tiny_llama_path, tmp_path):
    out = tmp_path / "ss.json"
    session_server.run(bench_args(session_server, [
        "--model", str(tiny_llama_path), "--context", "300", "--ingest", "150", "--questions", "3",
        "--pause-s", "0", "0.01", "--out", str(out),
        "--serve-args", "--dtype float32 --num-blocks 256 --background-chunk-tokens 16"]))
    result = json.loads(out.read_text())
    assert len(result["idle_ms"]) == 3 and all(ms > 0 for ms in result["idle_ms"])
    assert len(result["during_ingest_ms"]) <= 3 and result["ingest_tokens"] > 100
    summary = result["summary"]
    assert summary["questions during ingest"] == len(result["during_ingest_ms"])
    assert summary["background steps stopped"] >= 0 and summary["ingest tok/s"] > 0
