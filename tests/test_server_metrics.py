"""/metrics is Prometheus text written by prometheus-client (HELP and TYPE for every family, label
values escaped); a stream with nothing to send sends `: keep-alive` comments, which the openai SDK
ignores, without ending the request it waits on."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from spanserve.config import EngineConfig
from spanserve.engine.async_engine import AsyncLLM
from spanserve.engine.llm_engine import LLMEngine
from spanserve.server import app as server_app
from spanserve.server.app import create_app, sse
from spanserve.server.metrics import ServerMetrics

NUM_BLOCKS = 64
KEEP_ALIVE = ": keep-alive\n\n"


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    llm = AsyncLLM(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype="float32",
                                                  num_blocks=NUM_BLOCKS)))
    yield llm, create_app(llm, "tiny")
    llm.shutdown()


@pytest.fixture
def quick_keep_alive(monkeypatch):
    monkeypatch.setattr(server_app, "SSE_KEEPALIVE_S", 0.02)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)


def test_metrics_parse_as_prometheus_text_with_help_and_type_for_every_family(served):
    _, app = served

    async def run():
        async with _client(app) as client:
            done = await client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3})
            assert done.status_code == 200, done.text
            return await client.get("/metrics")

    r = asyncio.run(run())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for family in families.values():  # the parser calls a family with no TYPE line "unknown"
        assert family.documentation and family.type != "unknown", family.name
    counters = ["requests", "prompt_tokens", "generation_tokens", "cached_prompt_tokens", "span_tokens",
                "span_hit_tokens", "num_preemptions", "background_steps_stopped"]
    gauges = ["num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free",
              "kv_cache_usage", "prefix_cache_hit_rate", "span_hit_rate"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"]
    expected = {**dict.fromkeys(counters, "counter"), **dict.fromkeys(gauges, "gauge"),
                **dict.fromkeys(histograms, "histogram")}
    assert {name: families[f"spanserve_{name}"].type for name in expected} == expected
    samples = {(s.name, tuple(s.labels.items())): s.value for f in families.values() for s in f.samples}
    assert samples["spanserve_requests_total", (("status", "ok"),)] >= 1
    assert samples["spanserve_requests_total", (("status", "abort"),)] == 0  # present before any abort
    assert samples["spanserve_generation_tokens_total", ()] >= 3
    assert samples["spanserve_kv_blocks_used", ()] + samples["spanserve_kv_blocks_free", ()] == NUM_BLOCKS
    assert samples["spanserve_time_to_first_token_seconds_count", ()] >= 1


def test_a_label_value_with_a_quote_a_backslash_and_a_newline_is_escaped(served):
    metrics = ServerMetrics(lambda: served[0].engine)  # a second registry beside the app's: no clash
    name = 'a "tiny" model \\ on\ntwo lines'
    Counter("spanserve_test_requests", "Requests by model", ["model"], registry=metrics.registry).labels(name).inc()
    text = metrics.render().decode()
    assert 'spanserve_test_requests_total{model="a \\"tiny\\" model \\\\ on\\ntwo lines"} 1.0' in text
    [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "spanserve_test_requests_total"]
    assert sample.labels == {"model": name}


def test_each_app_counts_in_its_own_registry(served):
    first, second = ServerMetrics(lambda: served[0].engine), ServerMetrics(lambda: served[0].engine)
    first.requests.labels("ok").inc()
    assert first.registry.get_sample_value("spanserve_requests_total", {"status": "ok"}) == 1
    assert second.registry.get_sample_value("spanserve_requests_total", {"status": "ok"}) == 0


def _chat_chunk(text: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]}


def test_a_slow_stream_sends_keep_alive_comments_the_openai_sdk_ignores(quick_keep_alive):
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def slow_chat():
        async def chunks():
            for text in ("Hel", "lo"):
                await asyncio.sleep(0.15)  # several keep-alive intervals
                yield _chat_chunk(text)
        return sse(chunks())

    async def run():
        async with _client(app) as http:
            raw = (await http.post("/v1/chat/completions", json={})).text
            sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            stream = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       stream=True)
            return raw, [chunk.choices[0].delta.content async for chunk in stream]

    raw, texts = asyncio.run(run())
    events = raw.split("\n\n")[:-1]
    assert events.count(KEEP_ALIVE.strip()) >= 2
    assert [e for e in events if e.startswith("data: ")] == [
        f"data: {json.dumps(_chat_chunk('Hel'))}", f"data: {json.dumps(_chat_chunk('lo'))}", "data: [DONE]"]
    assert texts == ["Hel", "lo"]


def test_a_span_query_waiting_for_the_engine_sends_keep_alives_then_its_events(served, quick_keep_alive):
    llm, app = served

    async def run():
        async with _client(app) as client:
            busy = asyncio.ensure_future(llm.call(lambda: time.sleep(0.3)))  # the engine thread, held
            await asyncio.sleep(0.05)
            query = {"g": {"input": {"user": "Hello"}, "max_tokens": 4, "temperature": 0}}
            reply = await client.post("/v1/spans", json={"query": query, "stream": True})
            await busy
            return reply

    reply = asyncio.run(run())
    assert reply.status_code == 200, reply.text
    events = reply.text.split("\n\n")[:-1]
    assert events[0] == KEEP_ALIVE.strip() and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1] if e.startswith("data: ")]
    assert "".join(c["delta"] for c in chunks[:-1]) == chunks[-1]["result"]["text"]


def test_a_stream_closed_while_a_chunk_is_pending_ends_the_request_and_keep_alives_do_not(quick_keep_alive):
    seen = []

    async def chunks():
        try:
            await asyncio.sleep(0.15)  # outlasts several keep-alives, which leave it running
            yield {"n": 1}
            await asyncio.sleep(60)
            yield {"n": 2}
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def run():
        body = sse(chunks()).body_iterator
        events = [await anext(body)]
        while events[-1] == KEEP_ALIVE:
            events.append(await anext(body))
        assert len(events) >= 2 and events[-1] == 'data: {"n": 1}\n\n'
        assert await anext(body) == KEEP_ALIVE and not seen
        await body.aclose()  # the client went away
        return seen

    assert asyncio.run(run()) == ["cancelled"]
