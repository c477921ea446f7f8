"""`spanserve bench serve`: its statistics on hand-made numbers, and a short run against a real server."""

import argparse
import asyncio
import json

import httpx
import pytest
from server_utils import ServerProcess

from benchmarks import serve, server_steps


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
    steps = data["server_steps"]  # the server's engine during the run, from its /metrics
    assert steps["steps"]["decode"] > 0 and sum(steps["steps"].values()) >= 6  # each request prefills once
    assert 0 < steps["busy_pct"] <= 101 and 0 < steps["model_pct_of_steps"] < 100
    assert 0 < steps["decode_model_ms"] < steps["decode_step_ms"] and 1 <= steps["decode_batch"] <= 3

    capsys.readouterr()
    serve.run(_args(["--report", str(out), str(out)]))  # a run against itself: every ratio is 1
    ttft_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("TTFT p50 ms"))
    assert ttft_row.split()[-2:] == ["1.00x", "lower"]


def _metrics_text(*replicas: tuple[str | None, int, float]) -> str:
    """/metrics with the step counters of each (replica label or None, decode steps, decode seconds)."""
    def family(name: str, value) -> list[str]:
        lines = [f"# TYPE {name}_total counter"]
        for replica, steps, seconds in replicas:
            label = f',replica="{replica}"' if replica else ""
            decode, prefill = value(steps, seconds)
            lines += [f'{name}_total{{kind="decode"{label}}} {decode}',
                      f'{name}_total{{kind="prefill"{label}}} {prefill}']
        return lines
    return "\n".join([
        *family("spanserve_engine_steps", lambda steps, seconds: (steps, 2)),
        *family("spanserve_engine_step_tokens", lambda steps, seconds: (8 * steps, 300)),
        *family("spanserve_engine_step_seconds", lambda steps, seconds: (seconds, 1.0)),
        *family("spanserve_engine_model_seconds", lambda steps, seconds: (0.9 * seconds, 0.9)),
        "# TYPE spanserve_requests_total counter", 'spanserve_requests_total{status="ok"} 3', "",
    ])


class _Served:
    """An httpx transport answering /metrics with the given texts, one per request (None: a 404)."""

    def __init__(self, *texts: str | None):
        self.texts = list(texts)

    def client(self) -> httpx.AsyncClient:
        def answer(request):
            text = self.texts.pop(0)
            return httpx.Response(404) if text is None else httpx.Response(200, text=text)
        return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def test_server_steps_split_a_run_into_model_host_and_idle_time():
    async def read(*texts):
        async with _Served(*texts).client() as client:
            return [await server_steps.read(client, "http://server/metrics") for _ in texts]

    before, after = asyncio.run(read(_metrics_text((None, 10, 0.5)), _metrics_text((None, 110, 3.5))))
    s = server_steps.summarize(before, after, duration_s=4.0)
    assert s["steps"] == {"decode": 100, "prefill": 0}
    assert s["busy_pct"] == pytest.approx(75.0) and s["model_pct_of_steps"] == pytest.approx(90.0)
    assert s["host_ms_per_step"] == pytest.approx(3.0) and s["decode_step_ms"] == pytest.approx(30.0)
    assert s["decode_model_ms"] == pytest.approx(27.0) and s["decode_batch"] == pytest.approx(8.0)
    # a cluster's replicas are summed; a server without the counters, or a refused scrape, gives None
    [both] = asyncio.run(read(_metrics_text(("a", 10, 0.5), ("b", 20, 1.5))))
    assert both["decode"]["steps"] == 30 and both["decode"]["seconds"] == pytest.approx(2.0)
    assert asyncio.run(read('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n', None)) == [
        None, None]
    assert server_steps.summarize(None, after, 1.0) is None


def test_metrics_url_is_beside_the_openai_routes():
    assert server_steps.metrics_url("http://127.0.0.1:8012/v1") == "http://127.0.0.1:8012/metrics"
    assert server_steps.metrics_url("http://h:1/v1/") == "http://h:1/metrics"
