"""AsyncLLM builds its engine on the thread that steps it (one OpenMP thread team), and a build that
fails raises in the constructor."""

import asyncio
import threading

import pytest
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

        def recording_step():
            threads["step"] = threading.current_thread()
            return step()

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
