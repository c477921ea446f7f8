"""Speculative decoding on CUDA (tiny random model, float32): verify steps replayed as CUDA graphs
(as many tokens in every sequence) and run eagerly (a batch whose sequences check different
numbers of drafts) give the greedy tokens of the CPU engine without speculation; a draft model
on the GPU too; a seeded sampled request replays the same. Skipped without CUDA."""

import pytest
import torch
from helpers import assert_engine_idle, greedy, looping, random_prompt, token_ids

from spanserve import LLM, SamplingParams

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [{"prompt_token_ids": p} for p in (looping(40, 1), random_prompt(23, seed=2), looping(75, 3))]


def make_llm(path, device, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", device=device, num_blocks=256, **kwargs)


@pytest.fixture(scope="module")
def expected(tiny_llama_path):
    """The CPU engine's greedy tokens without speculation: one prompt alone, then the batch."""
    cpu = make_llm(tiny_llama_path, "cpu")
    return token_ids(cpu.generate(PROMPTS[:1], greedy(40))), token_ids(cpu.generate(PROMPTS, greedy(40)))


@pytest.mark.parametrize("eager", [False, True])
def test_ngram_drafts_on_cuda_keep_the_cpu_output(tiny_llama_path, expected, eager):
    llm = make_llm(tiny_llama_path, "cuda", enforce_eager=eager, speculative_config=NGRAM)
    assert token_ids(llm.generate(PROMPTS[:1], greedy(40))) == expected[0]
    assert token_ids(llm.generate(PROMPTS, greedy(40))) == expected[1]
    speculator = llm.engine.speculator
    assert speculator.num_accepted > 3 and speculator.num_drafted > speculator.num_accepted
    if not eager:  # batch 1 checked its drafts in replayed verify graphs
        assert any(size == 1 and q > 1 for size, q, _ in llm.engine.runner.graphs.graphs)
    assert_engine_idle(llm)


def test_a_draft_model_on_cuda_keeps_the_cpu_output(tiny_llama_path, expected):
    """The target as its own draft, both on the GPU: its greedy drafts all stand."""
    llm = make_llm(tiny_llama_path, "cuda", speculative_config={
        "method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 3})
    assert token_ids(llm.generate(PROMPTS[:1], greedy(40))) == expected[0]
    speculator = llm.engine.speculator
    assert speculator.num_drafted > 20 and speculator.num_accepted >= speculator.num_drafted * 0.6
    assert_engine_idle(llm)


def test_a_seeded_sampled_request_replays_on_cuda(tiny_llama_path):
    llm = make_llm(tiny_llama_path, "cuda", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=30)
    first, again = (llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids for _ in range(2))
    assert first == again and len(first) == 30
