"""`spanserve bench serve`: its statistics on hand-made numbers, and a short run against a real server."""

import argparse
import json

import pytest
from server_utils import ServerProcess

from benchmarks import serve


def _record(ttft: float, itl: list[float], prompt: int, cached: int) -> dict:
    e2e = ttft + sum(itl)
    return {"ok": True, "error": None, "ttft_s": ttft, "itl_s": itl, "e2e_s": e2e, "chunks": len(itl) + 1,
            "prompt_tokens": prompt, "output_tokens": len(itl) + 1, "cached_tokens": cached}


def test_percentile():
    assert serve.percentile([], 50) is None
    assert serve.percentile([7.0], 99) == 7.0
    assert serve.percentile([3.0, 1.0, 4.0, 2.0], 50) == 2.5
    assert serve.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert serve.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0) == 1.0


def test_summarize():
    failed = {**_record(0.0, [], 0, 0), "ok": False, "error": "HTTP 500"}
    records = [_record(0.1, [0.01, 0.03], 10, 0), _record(0.3, [0.02, 0.02], 20, 16), failed]
    s = serve.summarize(records, duration_s=2.0)
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert (s["prompt_tokens"], s["output_tokens"], s["cached_tokens"]) == (30, 6, 16)
    assert s["requests_per_s"] == 1.0 and s["output_tok_s"] == 3.0 and s["total_tok_s"] == 18.0
    assert s["ttft_p50_ms"] == pytest.approx(200) and s["ttft_p99_ms"] == pytest.approx(298)
    assert s["itl_p50_ms"] == pytest.approx(20) and s["itl_p99_ms"] == pytest.approx(29.7)
    assert s["tpot_p50_ms"] == pytest.approx(20) and s["e2e_p50_ms"] == pytest.approx(240)
    none = serve.summarize([failed], 1.0)
    assert none["ttft_p50_ms"] is None and none["cached_tokens"] is None  # unknown, not 0


def test_workload_is_seeded_and_balanced():
    work = serve.make_workload([32, 256], 6, seed=3)
    assert work == serve.make_workload([32, 256], 6, seed=3) != serve.make_workload([32, 256], 6, seed=4)
    assert sorted(t for t, _ in work) == [32, 32, 32, 256, 256, 256]
    assert all(abs(len(p) - t * serve.CHARS_PER_TOKEN) < 20 for t, p in work)  # whole words


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    proc = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "512"],
                         tmp_path_factory.mktemp("bench-server") / "server.log")
    yield proc
    proc.stop()


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_against_a_real_server(server, tiny_llama_path, tmp_path, endpoint, capsys):
    out = tmp_path / f"{endpoint}.json"
    data = serve.run(_args(["--url", f"{server.url}/v1", "--num-requests", "6", "--concurrency", "3",
                            "--max-tokens", "4", "--prompt-lens", "16,64", "--endpoint", endpoint,
                            "--out", str(out)]))
    s = data["summary"]
    assert [r["error"] for r in data["requests"]] == [None] * 6
    assert (s["requests"], s["completed"], s["errors"]) == (6, 6, 0)
    assert [r["output_tokens"] for r in data["requests"]] == [4] * 6  # ignore_eos: exactly max_tokens
    assert s["output_tokens"] == 24 and s["prompt_tokens"] == sum(r["prompt_tokens"] for r in data["requests"]) > 0
    assert 0 <= s["cached_tokens"] <= s["prompt_tokens"]
    for metric in ("ttft", "itl", "e2e"):
        assert 0 < s[f"{metric}_p50_ms"] <= s[f"{metric}_p99_ms"]
    assert s["ttft_p50_ms"] <= s["e2e_p50_ms"]
    assert data["model"] == tiny_llama_path.stem and data["label"] == f"127.0.0.1-{server.port}"
    assert json.loads(out.read_text())["summary"] == s

    capsys.readouterr()
    serve.run(_args(["--report", str(out), str(out)]))  # a run against itself: every ratio is 1
    ttft_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("TTFT p50 ms"))
    assert ttft_row.split()[-2:] == ["1.00x", "lower"]
