"""The OpenAI-compatible server, end to end: `spanserve serve` runs as a real subprocess on 127.0.0.1
and is driven with the official `openai` client, raw httpx, and schemathesis.

Greedy (and seeded) results over HTTP must equal the offline `LLM` API's for the same prompt.
"""

import asyncio
import itertools
import json
import re
import threading

import httpx
import jsonschema_rs
import openai
import pytest
import schemathesis
from helpers import greedy
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from server_utils import ServerProcess, assert_openai_error, metrics, parse_metrics, wait_for_metrics

from spanserve import LLM, SamplingParams, Span, __version__

NUM_BLOCKS = "2048"  # 32k tokens of KV cache: plenty for these tests, and light on memory
MAX_MODEL_LEN = 512  # the tiny models' max_position_embeddings
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]
NO_EOS = {"ignore_eos": True}  # random weights: EOS may come at any step; the tests want exact lengths


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_path, tmp_path_factory):
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", NUM_BLOCKS],
                           tmp_path_factory.mktemp("tiny-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded_server(tiny_llama_path, tmp_path_factory):
    """An API key, one sequence at a time, and room for one waiting request."""
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", NUM_BLOCKS,
                            "--api-key", "sekret", "--max-queued", "1", "--max-num-seqs", "1"],
                           tmp_path_factory.mktemp("guarded-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama_path):
    """The same model through the offline API: the reference for what the server must return."""
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=int(NUM_BLOCKS))


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def token_texts(llm: LLM, token_ids: list[int]) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.decode([t]) for t in token_ids]


# ---- plain endpoints ---------------------------------------------------------------------------


def test_health_version_models_openapi(tiny_server, client, tiny_llama_path):
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny_server.url}/version").json() == {"version": __version__}
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_llama_path.stem]
    assert models[0].object == "model" and models[0].owned_by == "spanserve"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    spec = httpx.get(f"{tiny_server.url}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    assert {"/health", "/version", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"} <= set(
        spec["paths"])
    completions = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "429"} <= set(completions) and "422" not in completions
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}


def test_metrics_prometheus_text(tiny_server, client, model_name):
    client.completions.create(model=model_name, prompt="metrics", max_tokens=3, temperature=0)
    r = httpx.get(f"{tiny_server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(r.text)
    gauges = ["spanserve_prompt_tokens_total", "spanserve_generation_tokens_total",
              "spanserve_cached_prompt_tokens_total", "spanserve_num_requests_running",
              "spanserve_num_requests_waiting", "spanserve_kv_blocks_used", "spanserve_kv_blocks_free",
              "spanserve_kv_cache_usage", "spanserve_prefix_cache_hit_rate", "spanserve_num_preemptions_total",
              "spanserve_span_tokens_total", "spanserve_span_hit_tokens_total", "spanserve_span_hit_rate",
              "spanserve_background_steps_stopped_total"]
    by_kind = ["spanserve_engine_steps_total", "spanserve_engine_step_tokens_total",
               "spanserve_engine_step_seconds_total", "spanserve_engine_model_seconds_total"]
    for name in gauges:
        assert name in samples, name
        assert f"# TYPE {name} " in r.text
    assert samples['spanserve_requests_total{status="ok"}'] >= 1
    assert samples["spanserve_kv_blocks_used"] + samples["spanserve_kv_blocks_free"] == int(NUM_BLOCKS)
    assert samples["spanserve_generation_tokens_total"] >= 3
    # the engine's steps: the prompt's prefill and two decode steps, each partly inside the model
    assert samples['spanserve_engine_steps_total{kind="decode"}'] >= 2
    assert samples['spanserve_engine_step_tokens_total{kind="decode"}'] >= 2
    assert samples['spanserve_engine_steps_total{kind="prefill"}'] + samples[
        'spanserve_engine_steps_total{kind="mixed"}'] >= 1
    for kind in ("decode", "prefill", "mixed"):
        assert all(f'{name}{{kind="{kind}"}}' in samples for name in by_kind)
        model = samples[f'spanserve_engine_model_seconds_total{{kind="{kind}"}}']
        assert 0 <= model <= samples[f'spanserve_engine_step_seconds_total{{kind="{kind}"}}']
    assert samples['spanserve_engine_model_seconds_total{kind="decode"}'] > 0
    for hist in ("spanserve_time_to_first_token_seconds", "spanserve_inter_token_latency_seconds",
                 "spanserve_e2e_request_latency_seconds"):
        assert f"# TYPE {hist} histogram" in r.text
        assert samples[f'{hist}_bucket{{le="+Inf"}}'] == samples[f"{hist}_count"]
    # the names the server renders are the ones metrics.py defines (and prometheus-client's `_created`)
    rendered = {line.split()[2] for line in r.text.splitlines()
                if line.startswith("# TYPE ") and not line.split()[2].endswith("_created")}
    assert rendered == {*gauges, *by_kind, "spanserve_requests_total", "spanserve_time_to_first_token_seconds",
                        "spanserve_inter_token_latency_seconds", "spanserve_e2e_request_latency_seconds"}


# ---- completions and chat through the official client ------------------------------------------


def test_completion_greedy_matches_offline(client, model_name, offline):
    expected = offline.generate(PROMPTS, greedy(12, logprobs=2))
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                      extra_body=NO_EOS)
        (choice,) = r.choices
        out = want.outputs[0]
        assert choice.text == out.text
        assert choice.finish_reason == "length"
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(out.token_ids) == 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12
        # the same token ids: one token text per generated token, with the offline logprobs
        lp = choice.logprobs
        assert lp.tokens == token_texts(offline, out.token_ids)
        assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(out.logprobs, out.token_ids)], abs=1e-4)
        assert len(lp.top_logprobs) == 12
        for token, top in zip(lp.tokens, lp.top_logprobs):
            assert token in top and 1 <= len(top) <= 3  # the 2 most likely, plus the chosen one
            assert all(v <= 0 for v in top.values())
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]


def test_completion_token_id_prompts_and_echo(client, model_name, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[0])
    want = offline.generate({"prompt_token_ids": ids}, greedy(6))[0].outputs[0].text
    r = client.completions.create(model=model_name, prompt=[ids, ids], max_tokens=6, temperature=0, echo=True,
                                  extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [PROMPTS[0] + want] * 2
    assert r.usage.prompt_tokens == 2 * len(ids) and r.usage.completion_tokens == 12


def test_completion_streaming_matches_offline_with_usage(client, model_name, offline):
    prompt = " ".join(f"streaming-usage-{i}" for i in range(12))  # unique, and two KV blocks long at least
    want = offline.generate(prompt, greedy(10))[0]
    usages = []
    for _ in range(2):  # the second time the prompt's full blocks come from the prefix cache
        text, finish, usage = "", [], None
        for chunk in client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body=NO_EOS):
            assert chunk.object == "text_completion"
            if chunk.usage is not None:
                assert chunk.choices == [] and usage is None
                usage = chunk.usage
                continue
            (choice,) = chunk.choices
            text += choice.text
            finish.append(choice.finish_reason)
        assert text == want.outputs[0].text
        assert finish[-1] == "length" and set(finish[:-1]) <= {None}
        assert usage.completion_tokens == 10 and usage.prompt_tokens == len(want.prompt_token_ids)
        usages.append(usage)
    assert usages[0].prompt_tokens >= 32
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < usages[1].prompt_tokens


def test_chat_greedy_matches_offline(client, model_name, offline):
    want = offline.chat(CHAT, greedy(12, logprobs=2))[0]
    out = want.outputs[0]
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    (choice,) = r.choices
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == out.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 12
    content = choice.logprobs.content
    assert [c.token for c in content] == token_texts(offline, out.token_ids)
    assert [c.logprob for c in content] == pytest.approx([d[t] for d, t in zip(out.logprobs, out.token_ids)],
                                                         abs=1e-4)
    for c in content:
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely one
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and c.top_logprobs[1].logprob <= c.logprob

    # streamed: a role delta first, then content deltas that add up to the same text
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt ran just before


def test_n2_seeded_sampling_matches_offline(client, model_name, offline):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    want = [c.text for c in offline.generate(PROMPTS[1], params)[0].outputs]
    assert want[0] != want[1]
    r = client.completions.create(model=model_name, prompt=PROMPTS[1], n=2, temperature=1.0, seed=7, max_tokens=8,
                                  extra_body=NO_EOS)
    assert sorted((c.index, c.text) for c in r.choices) == [(0, want[0]), (1, want[1])]
    assert r.usage.completion_tokens == 16

    texts, finished = {0: "", 1: ""}, set()
    for chunk in client.completions.create(model=model_name, prompt=PROMPTS[1], n=2, temperature=1.0, seed=7,
                                           max_tokens=8, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == {0: want[0], 1: want[1]} and finished == {0, 1}

    want_chat = [c.text for c in offline.chat(CHAT, params)[0].outputs]
    r = client.chat.completions.create(model=model_name, messages=CHAT, n=2, temperature=1.0, seed=7, max_tokens=8,
                                       extra_body=NO_EOS)
    assert sorted((c.index, c.message.content) for c in r.choices) == [(0, want_chat[0]), (1, want_chat[1])]
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=model_name, messages=CHAT, n=2, temperature=1.0, seed=7,
                                                max_tokens=8, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: want_chat[0], 1: want_chat[1]}


def test_stop_strings(client, model_name, offline):
    full = offline.generate(PROMPTS[2], greedy(24))[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    r = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop,
                                  extra_body=NO_EOS)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=["no such text", stop],
        stream=True, extra_body=NO_EOS))
    assert streamed == expected

    chat_full = offline.chat(CHAT, greedy(24))[0].outputs[0].text
    chat_stop = chat_full[len(chat_full) // 2:len(chat_full) // 2 + 3]
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0,
                                       stop=[chat_stop], extra_body=NO_EOS)
    assert r.choices[0].message.content == chat_full[:chat_full.index(chat_stop)]
    assert r.choices[0].finish_reason == "stop"


def test_32_concurrent_streaming_clients(tiny_server, model_name, offline):
    prompts = [f"Client {i} asks about topic number {i * 7}:" for i in range(32)]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(16))]

    async def one(aclient, prompt):
        text, finish = "", None
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True, extra_body=NO_EOS)
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(main())
    assert [text for text, _ in results] == expected
    assert {finish for _, finish in results} == {"length"}


# ---- client disconnects: the request is aborted and its blocks go back to the pool -------------


def _idle(samples):
    return samples["spanserve_num_requests_running"] == 0 and samples["spanserve_num_requests_waiting"] == 0


def test_streaming_client_disconnect_frees_blocks(tiny_server):
    before = wait_for_metrics(tiny_server.url, _idle, timeout=30)
    aborts = before.get('spanserve_requests_total{status="abort"}', 0)
    body = {"prompt": "Tell me a very long story.", "max_tokens": 480, "n": 2, "temperature": 1.0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (dropping a half-read iterator would close the connection already)
            events = [line for line in itertools.islice(lines, 6) if line.startswith("data: ")]
            assert len(events) == 3 and "[DONE]" not in events[-1]
            during = metrics(tiny_server.url)
            assert during["spanserve_kv_blocks_used"] > before["spanserve_kv_blocks_used"]
            assert during["spanserve_num_requests_running"] == 2
    _assert_aborted_and_freed(tiny_server.url, before, aborts)


def test_non_streaming_client_timeout_frees_blocks(tiny_server):
    before = wait_for_metrics(tiny_server.url, _idle, timeout=30)
    aborts = before.get('spanserve_requests_total{status="abort"}', 0)
    body = {"prompt": "Tell me another very long story.", "max_tokens": 480, "n": 4, "temperature": 1.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.6))
    _assert_aborted_and_freed(tiny_server.url, before, aborts)


def _assert_aborted_and_freed(url: str, before: dict, aborts: float) -> None:
    """Once the client has left, its blocks are back and one more abort is counted: the request was
    aborted, not run to its end (which would count it "ok"). No wall-clock bound: it would flake
    on a loaded machine, and the abort count already tells an abort from a finish."""
    after = wait_for_metrics(url, lambda s: s["spanserve_kv_blocks_used"] == before[
        "spanserve_kv_blocks_used"] and s.get('spanserve_requests_total{status="abort"}', 0) == aborts + 1,
        timeout=30)
    assert after["spanserve_kv_blocks_used"] == before["spanserve_kv_blocks_used"]
    assert after['spanserve_requests_total{status="abort"}'] == aborts + 1
    assert _idle(after)


# ---- position-independent spans -------------------------------------------------------------

DOCS = ["The capital of Zorbia is Quellen, a city of bridges. " * 4, "Mount Tarvo is 4,100 meters high. " * 5]


def test_completion_prompt_parts_match_offline_and_reuse_reordered_documents(tiny_server, model_name, offline):
    def parts(docs):
        return ["Context:", *({"text": d, "span": True} for d in docs), "Question: how high is Tarvo?"]

    def post(docs):
        body = {"model": model_name, "prompt": parts(docs), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first, second = post(DOCS), post(DOCS[::-1])
    expected = offline.generate(["Context:", *map(Span, DOCS[::-1]), "Question: how high is Tarvo?"], greedy(6))
    assert second["choices"][0]["text"] == expected[0].outputs[0].text
    doc_tokens = sum(len(offline.get_tokenizer().encode(d)) for d in DOCS)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= doc_tokens - 2 * 16
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
    samples = metrics(tiny_server.url)
    assert samples["spanserve_span_hit_tokens_total"] >= doc_tokens - 2 * 16
    assert samples["spanserve_span_hit_rate"] == round(
        samples["spanserve_span_hit_tokens_total"] / samples["spanserve_span_tokens_total"], 6)


@pytest.mark.parametrize("policy", [{"link_policy": "gap", "gap_length": 16},
                                    {"link_policy": "ape", "ape_temperature": 0.5, "ape_scale": 0.7},
                                    {"link_policy": "blend", "blend_ratio": 0.3, "blend_layers": 2},
                                    {"link_policy": "none", "focus_spans": 1},
                                    {"link_policy": "none", "focus_tokens": 32}])
def test_token_prompt_spans_and_link_policy_match_offline(client, model_name, offline, policy):
    tokens = [7 + i % 50 for i in range(80)]
    extra = {"spans": [[16, 64]], **policy, "ignore_eos": True}
    out = client.completions.create(model=model_name, prompt=tokens, max_tokens=6, temperature=0, extra_body=extra)
    expected = offline.generate({"prompt_token_ids": tokens, "spans": [[16, 64]]}, greedy(6, **policy))
    assert out.choices[0].text == expected[0].outputs[0].text


def test_chat_span_parts_reuse_documents_in_any_order(client, model_name, offline):
    def ask(docs):
        content = [{"type": "text", "text": d, "span": True} for d in docs] + [{"type": "text", "text": "Where?"}]
        return client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})

    ask(DOCS)
    reordered = ask(DOCS[::-1])
    assert reordered.usage.prompt_tokens_details.cached_tokens >= 64
    expected = offline.chat([{"role": "user", "content": [*map(Span, DOCS[::-1]), "Where?"]}], greedy(4))
    assert reordered.choices[0].message.content == expected[0].outputs[0].text


# ---- errors: the right status, an OpenAI-shaped body, never a 500 ------------------------------

OK = {"prompt": "hi", "max_tokens": 2}
CHAT_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_REQUESTS = [
    # (path, json body or raw bytes, status, part of the message, param)
    ("/v1/completions", b'{"prompt": "hi",', 400, "not valid JSON", None),
    ("/v1/completions", b"", 400, "", None),
    ("/v1/completions", [1, 2], 400, "", None),
    ("/v1/completions", {}, 400, "prompt", "prompt"),
    ("/v1/completions", {**OK, "max_tokens": "abc"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {**OK, "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "top_p"),
    ("/v1/completions", {**OK, "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {**OK, "top_k": 2**64}, 400, "top_k", "top_k"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n", "n"),
    ("/v1/completions", {**OK, "n": 17}, 400, "n", "n"),
    ("/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {**OK, "seed": 2**64}, 400, "seed", "seed"),
    ("/v1/completions", {**OK, "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ("/v1/completions", {**OK, "stop": ""}, 400, "stop", "stop"),
    ("/v1/completions", {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids.0"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "prompt"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {**OK, "prompt": [[]]}, 400, "prompt", "prompt"),
    ("/v1/completions", {**OK, "prompt": [5, -1]}, 400, "prompt", "prompt"),
    ("/v1/completions", {**OK, "prompt": [10**6]}, 400, "[0, 49152)", None),
    ("/v1/completions", {**OK, "prompt": [10**6], "stream": True}, 400, "[0, 49152)", None),
    ("/v1/completions", {**OK, "prompt": [5] * 600}, 400, "maximum context length is 512 tokens", None),
    ("/v1/completions", {**OK, "prompt": [5] * 600, "stream": True}, 400, "600 in the prompt", None),
    ("/v1/completions", {**OK, "max_tokens": 1000}, 400, "1000 for the completion", None),
    ("/v1/completions", {**OK, "model": "gpt-17"}, 404, "gpt-17", None),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages", "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role",
     "messages.0.role"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "text", "messages.0.content"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "text", "messages.0.content"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "maximum context length is 512 tokens", None),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "word " * 600}], "stream": True},
     400, "in the prompt", None),
    ("/v1/chat/completions", {**CHAT_OK, "model": "gpt-17"}, 404, "gpt-17", None),
    # position-independent spans (extension)
    ("/v1/completions", {**OK, "prompt": [5] * 64, "spans": [[0, 32], [16, 48]]}, 400, "spans overlap", None),
    ("/v1/completions", {**OK, "prompt": [5] * 64, "spans": [[32, 80]]}, 400, "inside the prompt", None),
    ("/v1/completions", {**OK, "prompt": [5] * 64, "spans": [[32, 32]]}, 400, "non-empty", None),
    ("/v1/completions", {**OK, "prompt": [5] * 64, "spans": [[8, 32]]}, 400, "block boundary", None),
    ("/v1/completions", {**OK, "prompt": [5] * 64, "spans": [[8]]}, 400, "spans", "spans.0"),
    ("/v1/completions", {**OK, "spans": [[0, 16]]}, 400, "token-id prompt", None),
    ("/v1/completions", {**OK, "prompt": [{"text": "doc", "span": "yes"}]}, 400, "prompt", None),
    ("/v1/completions", {**OK, "link_policy": "blender"}, 400, "link_policy", "link_policy"),
    ("/v1/completions", {**OK, "gap_length": -1}, 400, "gap_length", "gap_length"),
    ("/v1/completions", {**OK, "link_policy": "ape", "ape_temperature": 0}, 400, "ape_temperature", "ape_temperature"),
    ("/v1/completions", {**OK, "ape_scale": 1.5}, 400, "ape_scale", "ape_scale"),
    ("/v1/completions", {**OK, "blend_layers": 0}, 400, "blend_layers", "blend_layers"),
    ("/v1/completions", {**OK, "focus_spans": -1}, 400, "focus_spans", "focus_spans"),
    ("/v1/completions", {**OK, "link_policy": "gap", "focus_spans": 1}, 400, "focus_spans", None),
    ("/v1/completions", {**OK, "focus_tokens": -16}, 400, "focus_tokens", "focus_tokens"),
    ("/v1/completions", {**OK, "prompt": "\x16"}, 400, "no tokens", None),  # text the tokenizer drops
    ("/v1/completions", {**OK, "focus_spans": 1, "focus_tokens": 32}, 400, "focus_spans and focus_tokens", None),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "doc", "span": 1}]}]}, 400, "span", None),
]

# OpenAI fields this server does not implement: each refused by name when it asks for something
BAD_REQUESTS += [("/v1/chat/completions", {**CHAT_OK, field: value}, 400, "not supported", field) for field, value in [
    ("functions", [{"name": "f"}]), ("logit_bias", {"5": 10}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("store", True), ("metadata", {"k": "v"}), ("service_tier", "flex"),
]] + [("/v1/completions", {**OK, field: value}, 400, "not supported", field)
      for field, value in [("best_of", 3), ("suffix", "end"), ("logit_bias", {"5": 10})]] + [
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400,
     "name", "messages.0.name"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c"}]}, 400, "function", "messages.1.tool_calls.0.function"),
]


@pytest.mark.parametrize(("path", "body", "status", "message", "param"), BAD_REQUESTS,
                         ids=[f"{i}-{p.rsplit('/', 1)[-1]}-{s}" for i, (p, _, s, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_request(tiny_server, path, body, status, message, param):
    url = f"{tiny_server.url}{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    error = assert_openai_error(r, status, message)
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    if isinstance(body, dict) and "focus_spans" in body and ("focus_tokens" in body or "link_policy" in body):
        assert error["code"] == "invalid_link_policy"  # settings valid alone, not together
    if "no tokens" in message:
        assert error["code"] == "empty_prompt"
    if "maximum context length" in message or "for the completion" in message or "in the prompt" in message:
        assert error["code"] == "context_length_exceeded"


def test_openai_fields_that_ask_for_nothing_are_accepted(tiny_server):
    """The refused fields' neutral values (null, empty, text, none, false, auto) and the identifiers
    pass: clients that send defaults are served."""
    neutral = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True,
               "logit_bias": {}, "modalities": ["text"], "store": False, "service_tier": "auto", "user": "u1",
               "safety_identifier": "s1", "prompt_cache_key": "k1"}
    assert httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**CHAT_OK, **neutral}).status_code == 200
    assert httpx.post(f"{tiny_server.url}/v1/completions",
                      json={**OK, "best_of": 1, "suffix": None, "user": "u1"}).status_code == 200


def test_unknown_route_and_method(tiny_server):
    assert_openai_error(httpx.get(f"{tiny_server.url}/v1/engines"), 404)
    r = httpx.get(f"{tiny_server.url}/v1/completions")
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"


def test_still_correct_after_bad_requests(tiny_server, client, model_name, offline):
    """Odd but valid requests work, and after everything above the server still answers correctly."""
    # a stop token the model cannot produce, with min_tokens (it used to index past the logits)
    r = httpx.post(f"{tiny_server.url}/v1/completions",
                   json={**OK, "stop_token_ids": [10**8], "min_tokens": 1, "seed": -5, "top_k": 2**40,
                         "temperature": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] in (1, 2)
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**CHAT_OK, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": None}]})
    assert r.status_code == 200, r.text
    want = offline.generate(PROMPTS[0], greedy(8))[0].outputs[0].text
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body=NO_EOS)
    assert r.choices[0].text == want
    samples = metrics(tiny_server.url)
    assert samples['spanserve_requests_total{status="ok"}'] >= 1
    assert "internal error" not in tiny_server.log_tail(200_000)


# ---- API key and admission control --------------------------------------------------------------


def test_api_key(guarded_server):
    url = guarded_server.url
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401, "API key")
    error = assert_openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=OK), 401)
    assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=CHAT_OK,
                                   headers={"Authorization": "sekret"}), 401)
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.json()["object"] == "list"
    for path in ("/health", "/version", "/openapi.json"):  # /v1/* and /metrics are guarded
        assert httpx.get(f"{url}{path}").status_code == 200
    assert_openai_error(httpx.get(f"{url}/metrics"), 401)
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0) as good:
        r = good.chat.completions.create(model=good.models.list().data[0].id, messages=CHAT, max_tokens=3)
        assert r.usage.completion_tokens <= 3


def test_overload_gives_429_with_retry_after(guarded_server):
    """--max-num-seqs 1 --max-queued 1: one request runs, one waits, the next is turned away."""
    url, auth = guarded_server.url, {"Authorization": "Bearer sekret"}
    long = {"prompt": "Go on and on.", "max_tokens": 480, "temperature": 1.0, "ignore_eos": True}
    results = {}

    def post(name):
        results[name] = httpx.post(f"{url}/v1/completions", json=long, headers=auth, timeout=120)

    threads = []
    for name, ready in (("running", lambda s: s["spanserve_num_requests_running"] == 1),
                        ("waiting", lambda s: s["spanserve_num_requests_waiting"] == 1)):
        threads.append(threading.Thread(target=post, args=(name,)))
        threads[-1].start()
        assert ready(wait_for_metrics(url, ready, timeout=30, headers=auth)), name
    turned_away = [httpx.post(f"{url}/v1/completions", json=long, headers=auth) for _ in range(2)]
    still = metrics(url, auth)
    for t in threads:
        t.join()
    assert still["spanserve_num_requests_running"] == 1, "the first request ended before the test could overload"
    for r in turned_away:
        error = assert_openai_error(r, 429, "overloaded")
        assert error["type"] == "server_overloaded"
        assert int(r.headers["retry-after"]) >= 1
    assert results["running"].status_code == 200 and results["waiting"].status_code == 200
    assert results["waiting"].json()["usage"]["completion_tokens"] == 480
    # the queue drained: requests are admitted again
    r = httpx.post(f"{url}/v1/completions", json=OK, headers=auth)
    assert r.status_code == 200, r.text


def test_a_burst_is_counted_at_admission_before_any_request_starts():
    """--max-queued counts a request's sequences from the moment it is admitted, not from when its
    stream is first read: requests admitted in one burst cannot all slip past the limit, and a request
    of many prompts (or n) counts each of them."""
    from types import SimpleNamespace

    from spanserve.server.app import APIError, Server
    from spanserve.spans.limits import QueryLimits

    async def outputs():
        yield SimpleNamespace(outputs=[], finished=True)

    async def scenario():
        server = Server(SimpleNamespace(submit=lambda prompt, params, request_id, tenant: outputs()), "m", max_queued=2,
                        limits=QueryLimits())
        server._record = lambda *args: None
        first, second, third = (server.start("p", None, None) for _ in range(3))
        server.admit([first], 1)
        server.admit([second], 1)
        with pytest.raises(APIError) as refused:
            server.admit([third], 1)  # none of the admitted two has started yet
        assert refused.value.status == 429 and server.queued == 2
        del first  # admitted, never read (its client went away): its place comes back
        assert server.queued == 1
        assert [out.finished async for out in second] == [True] and server.queued == 0
        with pytest.raises(APIError) as never:
            server.admit([server.start("p", None, None)], 3)  # n=3: more than the queue holds, ever
        assert never.value.status == 400 and "3 model sequences" in never.value.message and server.queued == 0
        burst = [server.start("p", None, None), server.start("p", None, None)]
        server.admit(burst, 2)  # one request of several prompts: admitted together
        assert server.queued == 2
        with pytest.raises(APIError):
            server.admit([server.start("p", None, None)], 1)

    asyncio.run(scenario())


# ---- schemathesis: every operation of /openapi.json, against the live server ---------------------


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    return schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")


@pytest.fixture(scope="module")
def body_validators(api_schema):
    """Request-body JSON schemas by operation, checked with exact integers (jsonschema_rs)."""
    spec = api_schema.raw_schema
    validators = {}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None:
                validators[f"{method.upper()} {path}"] = jsonschema_rs.validator_for(
                    {**body, "components": spec["components"]})
    return validators


@pytest.fixture
def _node_id_for_schemathesis(request):
    """schemathesis 4.32's from_fixture() reads and rewrites the private `Node._nodeid`, which pytest 9.2 no
    longer has; give it the attribute (it only changes how the subtests are named)."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


schema = schemathesis.pytest.from_fixture("api_schema")


def _bound_generation(case) -> None:
    """Keep the random requests fast: a valid max_tokens stays valid, but at most 4 (the chat default is
    the whole context). Invalid values are left alone, so negative cases stay negative."""
    if not isinstance(case.body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(key)
        if type(value) in (int, float) and value > 4:
            case.body[key] = 4
    if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
        case.body["max_tokens"] = 4  # absent or null: the default would be the whole context


@pytest.mark.usefixtures("_node_id_for_schemathesis")
@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis(case, body_validators):
    _bound_generation(case)
    # Every built-in check but positive_data_acceptance, which would demand a 2xx for every body the schema
    # allows. Whether a request fits the model also depends on how many tokens its prompt makes (prompt +
    # max_tokens <= max_model_len), on which model name is served, whether its spans fit its prompt, and
    # whether a span query is well formed (its tree is free JSON), whether link policy comb has its plug-in,
    # whether a session exists and its retention fits its instructions, whether a sparse flow exists,
    # whether its text makes any token at all, whether its link policy settings go together, whether token
    # ids to embed or detokenize are within the vocabulary of the model that reads them, whether a regex,
    # grammar or JSON schema compiles,
    # and no JSON schema can say any of these;
    # the same check, minus those answers, follows.
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)
    validator = body_validators.get(case.operation.label)
    # (validated again: schemathesis's coverage phase has labelled numbers just past a bound as positive)
    if case.meta.generation.mode.is_positive and validator is not None and validator.is_valid(case.body):
        error = response.json().get("error", {}) if response.status_code >= 300 else {}
        assert response.status_code < 300 or (response.status_code, error.get("code")) in {
            (400, "context_length_exceeded"), (404, "model_not_found"), (400, "invalid_span"),
            (400, "invalid_query"), (400, "plugin_not_loaded"), (404, "session_not_found"),
            (400, "invalid_session"), (400, "invalid_sparse"), (400, "cache_full"), (400, "invalid_link_policy"),
            (400, "empty_prompt"), (400, "invalid_token_ids"), (400, "invalid_grammar"), (400, "invalid_tools")}, (
            response.status_code, response.text)


# ---- the real default model ----------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_server(tmp_path, smollm2_llm):
    server = ServerProcess(["--dtype", "float32", "--num-blocks", "256"], tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            (model,) = c.models.list().data
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            want = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
            r = c.chat.completions.create(model=model.id, messages=messages, temperature=0, max_tokens=20)
            assert r.choices[0].message.content == want
            assert "Paris" in want
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=model.id, messages=messages, temperature=0, max_tokens=20, stream=True))
            assert streamed == want
    finally:
        server.stop()


# ---- span queries --------------------------------------------------------------------------------

JUDGE = {"g": {"input": {"cross": [
    {"system": "You judge ideas."},
    {"plus": [{"g": {"input": {"user": f"Idea number {i}."}, "max_tokens": 6, "seed": i, "temperature": 0.5}}
              for i in range(3)]},
    {"user": "Which is best?"}]}, "max_tokens": 5}}


def test_span_query_endpoint_matches_offline_and_reuses_inner_calls(tiny_server, model_name, offline):
    r = httpx.post(f"{tiny_server.url}/v1/spans", json={"model": model_name, "query": JUDGE}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = offline.run_query(JUDGE)
    assert body["text"] == expected.text and len(body["calls"]) == 4
    assert body["calls"][-1]["path"] == "$" and body["calls"][-1]["cached_tokens"] >= 3 * 16
    assert body["calls"][-1]["ready_s"] >= body["calls"][-1]["ttft_s"] > 0


def test_span_query_streams_the_root_output(tiny_server, offline):
    with httpx.stream("POST", f"{tiny_server.url}/v1/spans", json={"query": JUDGE, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    result = chunks[-1]["result"]
    assert "".join(c["delta"] for c in chunks[:-1]) == result["text"] == offline.run_query(JUDGE).text


@pytest.mark.parametrize("query, path", [
    ({"g": {"input": {"cross": [{"user": "a"}, {"usr": "b"}]}}}, "$.g.input.cross[1]"),
    ({"user": "not a call"}, "$"),
    ({"g": {"input": {"user": "a"}, "max_tokens": 0}}, "$.g.max_tokens"),
    ({"chat": {"messages": [{"retrieve": "tides"}, {"user": "q"}]}}, "$"),  # this server has no --corpus
])
def test_bad_span_queries_are_400_naming_the_node(tiny_server, query, path):
    r = httpx.post(f"{tiny_server.url}/v1/spans", json={"query": query})
    assert assert_openai_error(r, 400, path)["message"].startswith(path)


def test_sparse_decode_over_http_matches_offline(client, model_name, offline):
    from helpers import random_prompt

    prompt = random_prompt(400, seed=7)  # over 4 budgets of 96 tokens: narrowed (sparse/decode.py NARROW_FROM)
    want = offline.generate({"prompt_token_ids": prompt}, greedy(6, sparse="quest", sparse_budget=96))[0]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={**NO_EOS, "sparse": "quest", "sparse_budget": 96})
    assert r.choices[0].text == want.outputs[0].text
    want = offline.generate({"prompt_token_ids": prompt}, greedy(6, sparse="quest", sparse_budget=96,
                                                                sparse_prefill=True))[0]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={**NO_EOS, "sparse": "quest", "sparse_budget": 96, "sparse_prefill": True})
    assert r.choices[0].text == want.outputs[0].text
    for body, message in [({"sparse": "nope"}, "unknown sparse flow"), ({"sparse": "quest", "sparse_budget": 32},
                                                                      "smaller than flow"),
                          ({"sparse_prefill": True}, "needs a sparse flow")]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=model_name, prompt="hi", max_tokens=2, extra_body=body)


def test_tokenize_and_detokenize_as_vllm_has_them(tiny_server):
    url = tiny_server.url
    text = "The harbour town exports salt."
    r = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    completion = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"]  # what a chat completion prompts with
    assert_openai_error(httpx.post(f"{url}/tokenize", json={"prompt": text, "messages": messages}), 400)
    assert_openai_error(httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}),
                        400, "add_generation_prompt")
    assert_openai_error(httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}), 400, "vocabulary")


def test_embeddings_are_the_retrieval_encoders_own(tiny_server):
    """/v1/embeddings gives what the encoder span queries retrieve with gives (all-MiniLM-L6-v2):
    texts, token ids, base64 and the openai SDK; never a truncated input or a silent model swap."""
    import base64

    import numpy as np
    from openai import OpenAI

    from spanserve.spans.retrieval import get_embedder

    url, encoder = tiny_server.url, get_embedder()
    texts = ["The harbour town of Velmont exports salt.", "Tarholm hosts a winter fair."]
    r = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "model": "all-MiniLM-L6-v2"}, timeout=60).json()
    got = np.array([d["embedding"] for d in r["data"]])
    assert np.allclose(got, encoder.encode(texts), atol=1e-5) and [d["index"] for d in r["data"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == sum(encoder.count_tokens(texts)) and got.shape == (2, 384)
    ids = encoder.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    by_ids = httpx.post(f"{url}/v1/embeddings", json={"input": ids, "encoding_format": "base64"}, timeout=60).json()
    vector = np.frombuffer(base64.b64decode(by_ids["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, got[0], atol=1e-5)
    sdk = OpenAI(base_url=f"{url}/v1", api_key="none").embeddings.create(input="salt", model="all-MiniLM-L6-v2")
    assert len(sdk.data[0].embedding) == 384
    assert_openai_error(httpx.post(f"{url}/v1/embeddings", json={"input": "x", "model": "gpt-4"}), 404, "embeds with")
    assert_openai_error(httpx.post(f"{url}/v1/embeddings", json={"input": "x", "dimensions": 128}), 400,
                        "dimensions")
    assert_openai_error(httpx.post(f"{url}/v1/embeddings", json={"input": "word " * 400}), 400, "never truncated")


def test_structured_outputs_over_http_with_the_openai_sdk(tiny_server):
    """response_format json_schema and json_object on chat, vLLM's structured_outputs on completions;
    a schema, regex or grammar that does not compile is a 400 naming the problem."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
              "properties": {"city": {"type": "string", "maxLength": 10}, "population": {"type": "integer"}}}
    validator = jsonschema_rs.validator_for(schema)
    with openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        for seed in range(3):
            reply = client.chat.completions.create(
                model=None, messages=[{"role": "user", "content": "A city?"}], max_tokens=80, seed=seed,
                temperature=1.0, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "city", "schema": schema, "strict": True}})
            choice = reply.choices[0]
            assert choice.finish_reason == "length" or validator.is_valid(json.loads(choice.message.content))
        anything = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "{"}],
                                                  max_tokens=60, temperature=0, response_format={"type": "json_object"})
        assert anything.choices[0].finish_reason == "length" or \
            isinstance(json.loads(anything.choices[0].message.content), dict)
        code = client.completions.create(model=None, prompt="Code:", max_tokens=10, temperature=1.0,
                                         extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.choices[0].text)
    url = f"{tiny_server.url}/v1"
    bad = httpx.post(f"{url}/completions", json={**OK, "structured_outputs": {"regex": "([0-9"}})
    assert assert_openai_error(bad, 400, "structured_outputs")["code"] == "invalid_grammar"
    both = httpx.post(f"{url}/chat/completions", json={**CHAT_OK, "response_format": {"type": "json_object"},
                                                       "structured_outputs": {"choice": ["a"]}})
    assert_openai_error(both, 400, "not both")
    judged = httpx.post(f"{url}/spans", json={"query": {"g": {"input": {"user": "A city?"}, "max_tokens": 80,
                                                              "temperature": 1.0, "seed": 2, "response_format": {
                                                                  "type": "json_schema",
                                                                  "json_schema": {"schema": schema}}}}})
    assert judged.status_code == 200 and validator.is_valid(json.loads(judged.json()["text"]))
    unknown = {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}
    bad_query = httpx.post(f"{url}/spans", json={"query": {"g": {"input": {"user": "x"}, "response_format": unknown}}})
    assert assert_openai_error(bad_query, 400, "structured_outputs")["code"] == "invalid_grammar"
