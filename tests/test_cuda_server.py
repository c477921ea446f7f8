"""`spanserve serve --device cuda` end to end (tiny random model, float32): completions with span
parts in two orders, streamed chat, and a streaming session whose old rows are evicted (its
keys rotated in place) answer as the offline API does on the CPU. Skipped without CUDA."""

import json
import time

import httpx
import pytest
import torch
from helpers import greedy

from spanserve import LLM, SamplingParams, Span

pytest.importorskip("triton")
pytest.importorskip("fastapi")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from server_utils import ServerProcess  # noqa: E402

DOCS = ["Tarvo is a hill of 412 metres in the north.", "Mira is a lake beside the old mill road.",
        "The mill stopped grinding in 1931 after the flood."]
ROWS = "".join(f"t={i:03d}, sensor={'ABC'[i % 3]}, value={(37 * i) % 101}\n" for i in range(40))
SYSTEM, RETENTION = "Answer from the log.", 400  # 40 rows are ~800 tokens: the oldest are evicted
QUESTION = "Which sensor reported 74?"


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-server")
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--device", "cuda",
                            "--num-blocks", "512", "--session-dir", str(root / "sessions")], root / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cpu(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", device="cpu", num_blocks=512)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_span_parts_in_a_new_order_answer_as_on_the_cpu(server, cpu):
    def complete(docs):
        prompt = ["Context:", *({"text": d, "span": True} for d in docs), "Question: how high is Tarvo?"]
        return post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})

    complete(DOCS)
    reordered = complete(DOCS[::-1])
    expected = cpu.generate(["Context:", *map(Span, DOCS[::-1]), "Question: how high is Tarvo?"], greedy(8))
    assert reordered["choices"][0]["text"] == expected[0].outputs[0].text
    assert reordered["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_streamed_chat_answers_as_on_the_cpu(server, cpu):
    messages = [{"role": "user", "content": "Name three rivers."}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if
                   json.loads(e)["choices"])
    assert text == cpu.chat(messages, greedy(8))[0].outputs[0].text


def test_a_session_with_evicted_rows_answers_as_on_the_cpu(server, cpu):
    sid = post(server, "/v1/sessions", {"system": SYSTEM, "retention_tokens": RETENTION})["id"]
    post(server, f"/v1/sessions/{sid}/data", {"text": ROWS})
    for _ in range(600):
        info = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()
        if info["visible_version"] == info["version"]:
            break
        time.sleep(0.05)
    assert info["num_tokens"] <= RETENTION  # rows were evicted: the kept keys moved
    answer = post(server, f"/v1/sessions/{sid}/query", {"question": QUESTION, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True})
    session = cpu.create_session(system=SYSTEM, retention_tokens=RETENTION)
    session.append(ROWS)
    session.wait()
    expected = session.query(QUESTION, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert session.info()["num_tokens"] == info["num_tokens"]
    assert answer["text"] == expected.text
