"""kv_cache_dtype: a bf16 KV cache under a float32 model. The kernels read it as they read a float32
one (the same keys, rounded once when stored), the torch path agrees with them, the pool holds
twice the tokens, and what it cannot run is refused at start."""

import pytest
import torch
from helpers import random_prompt
from test_attention import reference
from test_cpu_kernel import needs_kernel, paged, prefill_case

from spanserve import LLM, SamplingParams
from spanserve.config import EngineConfig
from spanserve.errors import InvalidRequestError
from spanserve.kernels import cpu_kernel

PROMPTS = [random_prompt(n, seed=n) for n in (5, 40, 130)]


@needs_kernel
def test_decode_kernel_reads_a_bf16_cache_under_float32_queries():
    """float32 queries over bf16 keys and values: the float32 attention over those rounded keys."""
    lens = [1, 19, 600]
    cache, tables, contexts = paged(lens, 16, 3, 64, torch.bfloat16)
    q = torch.randn(len(lens), 9, 64)
    out = cpu_kernel.paged_decode(q, cache[0], cache[1], tables, torch.tensor(lens), 0.3)
    assert out.dtype == torch.float32
    for i, (keys, values) in enumerate(contexts):
        expected = reference(q[i:i + 1].double(), keys.double(), values.double(), torch.tensor([lens[i] - 1]), 0.3)
        torch.testing.assert_close(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_prefill_kernel_reads_a_bf16_cache_under_float32_queries():
    q, cache, tables, contexts, starts, positions, lens = prefill_case(torch.bfloat16)
    q = q.float()
    out = cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, starts, positions, lens, 0.3)
    assert out.dtype == torch.float32
    for i, (keys, values) in enumerate(contexts):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = reference(q[rows].double(), keys.double(), values.double(), positions[rows], 0.3)
        torch.testing.assert_close(out[rows].double(), expected, rtol=5e-5, atol=5e-5)


def _generate(llm, n=12):
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


def test_a_bf16_cache_holds_twice_the_tokens_and_stays_near_float32(tiny_llama_path):
    exact = LLM(model=str(tiny_llama_path), dtype="float32", kv_cache_memory_gb=0.01)
    narrow = LLM(model=str(tiny_llama_path), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.01)
    assert narrow.engine.runner.kv_cache.dtype == torch.bfloat16
    assert narrow.engine.kv.pool.num_blocks in (2 * exact.engine.kv.pool.num_blocks,
                                                2 * exact.engine.kv.pool.num_blocks + 1)
    for a, b in zip(_generate(exact), _generate(narrow)):
        first = a.outputs[0].token_ids[0]
        assert b.outputs[0].token_ids[0] == first  # the prompt's logits moved by bf16 rounding only
        assert abs(a.outputs[0].logprobs[0][first] - b.outputs[0].logprobs[0][first]) < 0.05


def test_the_torch_path_reads_a_bf16_cache_as_the_kernels_do(tiny_llama_path, monkeypatch):
    """Every torch gather casts the cache's keys to the queries' dtype: same tokens, logprobs within
    float32 arithmetic of the C kernels'."""
    kernels = _generate(LLM(model=str(tiny_llama_path), dtype="float32", kv_cache_dtype="bfloat16"))
    monkeypatch.setattr(cpu_kernel, "_tried", True)
    monkeypatch.setattr(cpu_kernel, "_allowed", frozenset())
    torch_path = _generate(LLM(model=str(tiny_llama_path), dtype="float32", kv_cache_dtype="bfloat16"))
    for a, b in zip(kernels, torch_path):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            token = next(iter(x))
            assert abs(x[token] - y[token]) < 1e-3


def test_kv_cache_dtypes_the_kernels_cannot_read_are_refused_at_start():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype 'float16' is not one the attention kernels read"):
        EngineConfig(kv_cache_dtype="float16")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype 'int8' is not one"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(InvalidRequestError, match="CPU only"):
        EngineConfig(device="cuda", dtype="float32", kv_cache_dtype="bfloat16").torch_kv_cache_dtype()
    assert EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="bf16").torch_kv_cache_dtype() == torch.bfloat16
    assert EngineConfig(dtype="float32").torch_kv_cache_dtype() == torch.float32


def test_a_session_saved_from_a_bf16_cache_is_refused_by_a_float32_one(tiny_llama_path, tmp_path):
    narrow = LLM(model=str(tiny_llama_path), dtype="float32", kv_cache_dtype="bfloat16")
    session = narrow.create_session("You watch a feed.")
    session.append("row 1: 42\nrow 2: 17\n")
    session.wait()
    path = tmp_path / "s.safetensors"
    session.save(path)
    exact = LLM(model=str(tiny_llama_path), dtype="float32")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        exact.restore_session(path)
    params = SamplingParams(temperature=0, max_tokens=3)
    before = session.query("Which row?", params).text
    session.close()
    assert narrow.restore_session(path).query("Which row?", params).text == before
