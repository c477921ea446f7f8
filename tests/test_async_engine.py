"""AsyncLLM builds its engine on the thread that steps it (one OpenMP thread team), and a build that
fails raises in the constructor; a built engine is out of the garbage collector's passes."""

import asyncio
import gc
import threading
import weakref

import pytest
import torch
from helpers import greedy

from spanserve.config import EngineConfig
from spanserve.engine.async_engine import AsyncLLM
from spanserve.engine.llm_engine import LLMEngine
from spanserve.errors import ModelNotFoundError


def test_engine_is_built_and_stepped_on_the_engine_thread(tiny_llama_path):
    threads = {}

    def build():
        threads["build"] = threading.current_thread()
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), num_blocks=32))
        step = engine.step

        def recording_step(interrupt=None):
            threads["step"] = threading.current_thread()
            return step(interrupt)

        engine.step = recording_step
        return engine

    llm = AsyncLLM(build)
    try:
        async def run():
            outputs = [out async for out in llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, greedy(3))]
            return outputs[-1]

        final = asyncio.run(run())
        assert final.finished and len(final.outputs[0].token_ids) == 3
        assert threads["build"] is threads["step"] is llm._thread
        assert threads["build"] is not threading.current_thread()
    finally:
        llm.shutdown()


def test_a_build_that_fails_raises_in_the_constructor(tmp_path):
    with pytest.raises(ModelNotFoundError):
        AsyncLLM.from_config(str(tmp_path / "no-such-model"))


def test_an_engine_built_elsewhere_still_runs(tiny_llama_path):
    llm = AsyncLLM(LLMEngine(EngineConfig(model=str(tiny_llama_path), num_blocks=32)))
    try:
        async def run():
            return [out async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(2))][-1]

        assert len(asyncio.run(run()).outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_a_request_arriving_during_ingest_stops_the_ingest_step(tiny_llama_path):
    """A request put in the inbox while the engine thread runs a step of session ingest alone stops
    that step between layers (engine.step's `interrupt`); the request is answered, and the ingest
    completes afterwards."""
    in_ingest, arrived, results = threading.Event(), threading.Event(), []

    def build():
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), num_blocks=64))
        execute = engine.runner.execute

        def execute_after_arrival(batch, stop=None):
            if stop is not None and not results:  # the first stoppable (ingest) step waits for the request
                in_ingest.set()
                arrived.wait(10)
                results.append(execute(batch, stop))
                return results[-1]
            return execute(batch, stop)

        engine.runner.execute = execute_after_arrival
        return engine

    llm = AsyncLLM(build)
    try:
        async def run():
            def open_session():  # in one call: the engine thread steps the ingest right after
                session = llm.engine.sessions.create("Log.")
                session.append("".join(f"row {i}, value {i * 7 % 13}\n" for i in range(20)))
                return session

            session = await llm.call(open_session)
            assert await asyncio.to_thread(in_ingest.wait, 10)
            outputs = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(2))
            first = asyncio.ensure_future(outputs.__anext__())  # puts the request in the inbox
            while not llm._arrived.is_set():
                await asyncio.sleep(0.001)
            arrived.set()
            out = await first
            async for out in outputs:  # noqa: B007 (the last one is returned)
                pass
            while not await llm.call(session.caught_up):
                await asyncio.sleep(0.01)
            return out

        final = asyncio.run(run())
        assert results[0] is None and llm.engine.scheduler.background.num_stopped >= 1  # the ingest step stopped
        assert final.finished and len(final.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_a_request_is_tokenized_on_the_callers_thread_with_one_torch_thread(tiny_llama_path):
    """A parallel torch op on the event loop's thread would start a second OpenMP team, which slows
    every step of the engine's (async_engine.py): make_group runs there on one thread, and the
    caller's own count comes back afterwards."""
    llm = AsyncLLM.from_config(str(tiny_llama_path), num_blocks=32)
    counts = []
    make_group = llm.engine.make_group

    def recording(*args, **kwargs):
        counts.append((threading.current_thread(), torch.get_num_threads()))
        return make_group(*args, **kwargs)

    llm.engine.make_group = recording
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async def run():
            return [out async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(2))][-1]

        assert len(asyncio.run(run()).outputs[0].token_ids) == 2
        assert counts == [(threading.current_thread(), 1)]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        llm.shutdown()


def test_a_built_engine_is_out_of_the_garbage_collectors_passes(tiny_llama_path):
    """What a build allocates (model, tokenizer, imports) is frozen: a full collection no longer
    walks it between steps (on SmolLM2 such a pass took 124 ms). An engine dropped before the next
    build is still freed: the build collects before it freezes."""
    gc.unfreeze()
    first = LLMEngine(EngineConfig(model=str(tiny_llama_path), num_blocks=32))
    assert gc.get_freeze_count() > 0
    dropped = weakref.ref(first)
    del first
    LLMEngine(EngineConfig(model=str(tiny_llama_path), num_blocks=32))
    assert dropped() is None
