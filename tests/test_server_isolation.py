"""What one client does cannot hold up or wear down the server for the others: a request that
finds no room to start waits at most the engine's admission_timeout_s, then gets a 503 with
Retry-After (streamed or not, before any byte), and never holds up the smaller requests queued
behind it; oversized texts are refused before they are tokenized, and the memory their bodies
took goes back; a dropped stream leaves nothing running."""

import asyncio
import time

import httpx
import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt
from server_utils import ServerProcess

from spanserve import LLM
from spanserve.config import EngineConfig
from spanserve.engine.async_engine import AsyncLLM
from spanserve.engine.llm_engine import LLMEngine
from spanserve.errors import AdmissionTimeoutError, InvalidSessionError
from spanserve.server.app import create_app


def test_a_request_that_does_not_fit_now_does_not_hold_up_smaller_ones(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=50)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": random_prompt(500, seed=1)}, greedy(8), "first")
    engine.step()  # it runs, holding 32 of the 50 blocks
    engine.add_request({"prompt_token_ids": random_prompt(500, seed=2)}, greedy(8), "big")
    engine.add_request({"prompt_token_ids": random_prompt(20, seed=3)}, greedy(8), "small")
    engine.step()
    running = {req.group_id for req in engine.scheduler.running}
    assert running == {"first", "small"} and [r.group_id for r in engine.scheduler.waiting] == ["big"]
    while engine.has_unfinished_requests():  # the big one starts once the first has finished
        engine.step()
    assert_engine_idle(llm)


def test_a_request_with_no_room_to_start_ends_after_the_admission_timeout(tiny_llama_path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype="float32", num_blocks=50,
                                    admission_timeout_s=0.2))
    held = engine.kv.pool.allocate(40)  # others hold the pool
    engine.add_request({"prompt_token_ids": random_prompt(300, seed=1)}, greedy(4), "big")
    engine.add_request({"prompt_token_ids": random_prompt(20, seed=3)}, greedy(4), "small")
    done = set()
    started = time.monotonic()
    while "big" not in engine.failed and time.monotonic() - started < 5:
        done |= {out.request_id for out in engine.step() if out.finished}
    failed = engine.take_failed()
    assert isinstance(failed["big"], AdmissionTimeoutError) and "needs 19 KV blocks" in str(failed["big"])
    assert "big" not in engine.groups and engine.take_failed() == {}
    while engine.has_unfinished_requests():
        done |= {out.request_id for out in engine.step() if out.finished}
    assert done == {"small"}
    engine.kv.pool.release(held)


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    llm = AsyncLLM(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype="float32", num_blocks=50,
                                                  admission_timeout_s=0.3)))
    yield llm, create_app(llm, "tiny")
    llm.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_answers_503_with_retry_after_and_serves_the_small_request(served, stream):
    llm, app = served

    async def run():
        held = await llm.call(lambda: llm.engine.kv.pool.allocate(40))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                big = {"prompt": random_prompt(300, seed=1), "max_tokens": 4, "stream": stream}
                small = {"prompt": random_prompt(20, seed=2), "max_tokens": 4, "stream": stream}
                return await asyncio.gather(client.post("/v1/completions", json=big),
                                            client.post("/v1/completions", json=small))
        finally:
            await llm.call(lambda: llm.engine.kv.pool.release(held))

    big, small = asyncio.run(run())
    assert big.status_code == 503 and big.headers["retry-after"] == "5", big.text
    assert big.json()["error"]["code"] == "admission_timeout" and "retry later" in big.json()["error"]["message"]
    assert small.status_code == 200
    assert ("[DONE]" in small.text) if stream else small.json()["choices"][0]["finish_reason"] == "length"


def test_span_query_streams_dropped_mid_way_leave_no_task_pending(tiny_llama_path, tmp_path):
    """Five /v1/spans streams dropped by their clients mid-way: the server logs no task destroyed
    while pending (the stream's reader task used to be left behind), and stays idle after."""
    query = {"g": {"input": {"cross": [{"plus": [{"g": {"input": {"user": f"Idea {i}."}, "max_tokens": 60}}
                                              for i in range(3)]},
                                       {"user": "Which is best?"}]}, "max_tokens": 60}}
    log = tmp_path / "server.log"
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "256"], log)
    try:
        for _ in range(5):
            with httpx.stream("POST", f"{server.url}/v1/spans", json={"query": query, "stream": True},
                              timeout=60) as reply:
                assert reply.status_code == 200
                next(line for line in reply.iter_lines() if line.startswith("data:"))  # then the client leaves
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        server.stop()
    assert "Task was destroyed but it is pending" not in log.read_text()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_oversized_texts_are_refused_untokenized_and_their_memory_goes_back(tiny_llama_path, tmp_path):
    """30 MB prompts, as a completion, a chat and session data: each a 400 in well under a second
    (tokenizing them took 9 s and kept gigabytes), and the server's RSS back within 10% after."""
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "256"],
                           tmp_path / "server.log")
    big = "word " * 6_000_000
    try:
        url = server.url
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60).is_success
        session = httpx.post(f"{url}/v1/sessions", json={"system": "Log."}, timeout=60).json()["id"]
        baseline = _rss_mb(server.proc.pid)
        for _ in range(3):
            for path, body in (("/v1/completions", {"prompt": big, "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
                               (f"/v1/sessions/{session}/data", {"text": big})):
                started = time.monotonic()
                reply = httpx.post(f"{url}{path}", json=body, timeout=120)
                assert reply.status_code == 400, reply.text
                assert "at least" in reply.json()["error"]["message"] and time.monotonic() - started < 5
        time.sleep(0.5)
        assert _rss_mb(server.proc.pid) < 1.1 * baseline
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60).is_success
    finally:
        server.stop()


def test_session_questions_and_flash_work_count_against_max_queued(tiny_llama_path):
    """While the engine is busy, questions to a session take places in the queue like any request:
    past --max-queued they get 429; an append whose flash questions find no room does too."""
    llm = AsyncLLM(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype="float32", num_blocks=256)))
    app = create_app(llm, "tiny", max_queued=4)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as client:
            sid = (await client.post("/v1/sessions", json={"system": "Log.", "flash": ["Last?"]})).json()["id"]
            busy = asyncio.ensure_future(llm.call(lambda: time.sleep(1.0)))  # the engine thread, held
            await asyncio.sleep(0.1)
            question = {"question": "What is the last value?", "max_tokens": 4}
            asked = [asyncio.ensure_future(client.post(f"/v1/sessions/{sid}/query", json=question))
                     for _ in range(7)]
            await asyncio.sleep(0.3)  # all seven have asked (four hold the queue's places)
            appended = await client.post(f"/v1/sessions/{sid}/data", json={"text": "t=1, value=5\n"})
            replies = await asyncio.gather(*asked)
            await busy
            return appended, replies

    appended, replies = asyncio.run(run())
    llm.shutdown()
    codes = sorted(r.status_code for r in replies)
    assert codes == [200] * 4 + [429] * 3, [r.text for r in replies]
    assert appended.status_code == 429 and appended.headers["retry-after"] == "1"


def test_a_sessions_flash_work_per_append_is_bounded_and_told(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256, session_flash_budget=300)
    with pytest.raises(InvalidSessionError, match="over this server's budget of 300"):
        llm.create_session(system="Log.", flash=[f"Question {i}?" for i in range(8)], flash_max_tokens=30)
    session = llm.create_session(system="Log.", flash=["Last value?"], flash_max_tokens=30)
    info = session.info()
    assert info["flash_budget_tokens"] == 300 and 30 < info["flash_tokens_per_append"] <= 60
    session.close()
    assert_engine_idle(llm)


def test_an_append_the_backlog_cannot_take_now_is_a_429_and_one_it_never_can_a_400(tiny_llama_path):
    llm = AsyncLLM(lambda: LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype="float32", num_blocks=256)))
    app = create_app(llm, "tiny")
    rows = "".join(f"t={i}, value={i % 7}\n" for i in range(40))  # about 400 tokens

    def backlog_of_500(sid):
        """The session's backlog holds 500 tokens not computed yet (its ingest held back)."""
        session = llm.engine.sessions.get(sid)
        session._start_ingest = lambda: None
        session.append_tokens(list(range(100, 600)))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as client:
            sid = (await client.post("/v1/sessions", json={"system": "Log.", "retention_tokens": 160})).json()["id"]
            await llm.call(lambda: backlog_of_500(sid))
            later = await client.post(f"/v1/sessions/{sid}/data", json={"text": rows})
            never = await client.post(f"/v1/sessions/{sid}/data", json={"text": rows * 3})
            await client.delete(f"/v1/sessions/{sid}")
            return later, never

    later, never = asyncio.run(run())
    llm.shutdown()
    assert later.status_code == 429 and later.headers["retry-after"] == "1" and "retry once" in later.text
    assert never.status_code == 400 and "can never fit" in never.text


def test_the_servers_helper_threads_run_torch_on_one_thread(served):
    """A parallel torch op on a helper thread (asyncio.to_thread) would start a second OpenMP team
    beside the engine's, which slows every step: the app's helpers take one thread each."""
    _, app = served
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what a new thread would otherwise start with

    async def run():
        async with app.router.lifespan_context(app):
            return await asyncio.to_thread(torch.get_num_threads)

    try:
        assert asyncio.run(run()) == 1
        assert torch.get_num_threads() == 2  # the caller's own count is its own
    finally:
        torch.set_num_threads(before)
