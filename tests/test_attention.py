"""The CPU attention paths agree with a plain masked softmax attention."""

import pytest
import torch

from spanserve.attention import AttentionMetadata, torch_ref
from spanserve.attention.torch_ref import (
    BATCH_MAX_QUERIES,
    TorchAttention,
    _by_runs,
    _grouped_queries,
    _matmul_attention,
    _sdpa,
    causal_mask,
)
from spanserve.engine.runner import _runs


def reference(q, keys, values, positions, scale):
    """Each query sees the keys up to its own position (explicit softmax, float64)."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, 1)
    v = values.double().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~causal_mask(positions, len(keys))[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_run_by_run_and_masked_attention_equal_the_reference():
    torch.manual_seed(0)
    positions = torch.tensor([3, 4, 5, 10, 11, 20, 21, 22, 23, 40])  # four runs, one of a single query
    ctx, heads, kv_heads, dim = 41, 6, 2, 16
    q = torch.randn(len(positions), heads, dim)
    keys, values = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    expected = reference(q, keys, values, positions, 0.25)
    runs = _runs(positions.tolist())
    assert len(runs) == 4
    by_runs = _by_runs(q, keys, values, runs, 0.25)
    masked = _sdpa(q, keys, values, causal_mask(positions, ctx), 0.25)
    assert (by_runs.double() - expected).abs().max() < 1e-5
    assert (masked.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matmul_attention_over_scattered_queries_equals_the_reference(dtype, tolerance):
    """Queries in several runs (spans, CacheBlend) over head-major keys, in float32 and bf16."""
    torch.manual_seed(3)
    positions = torch.tensor([3, 4, 5, 10, 11, 20, 21, 22, 23, 40])
    ctx, heads, kv_heads, dim = 41, 6, 2, 16
    q = torch.randn(len(positions), heads, dim)
    keys, values = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    expected = reference(q, keys, values, positions, 0.25)
    out = _matmul_attention(q.to(dtype), keys.transpose(0, 1).contiguous().to(dtype),
                            values.transpose(0, 1).contiguous().to(dtype), positions, 0.25)
    assert out.dtype == dtype
    assert (out.double() - expected).abs().max() < tolerance


def test_batched_decode_over_padded_contexts_equals_the_reference():
    torch.manual_seed(1)
    lens, heads, kv_heads, dim = [5, 17, 9], 6, 2, 16
    q = torch.randn(len(lens), heads, dim)
    keys, values = torch.randn(len(lens), max(lens), kv_heads, dim), torch.randn(len(lens), max(lens), kv_heads, dim)
    mask = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    out = _grouped_queries(q[:, None], keys, values, mask[:, None, None, :], 0.25)[:, 0]
    for i, n in enumerate(lens):  # the newest token sees its whole context
        expected = reference(q[i:i + 1], keys[i, :n], values[i, :n], torch.tensor([n - 1]), 0.25)[0]
        assert (out[i].double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("matmul_max_scores", [torch_ref.MATMUL_MAX_SCORES, 0])
def test_a_step_of_decodes_short_and_long_prefills_over_the_paged_cache_equals_the_reference(
        monkeypatch, matmul_max_scores):
    """Decode tokens and short chunks go through one padded, masked call; the long chunk alone,
    as matmuls or (past the score budget) by flash passes."""
    monkeypatch.setattr(torch_ref, "MATMUL_MAX_SCORES", matmul_max_scores)
    torch.manual_seed(2)
    block_size, heads, kv_heads, dim = 4, 6, 2, 16
    query_lens, context_lens = [1, 4, BATCH_MAX_QUERIES + 8, 7, 1], [9, 13, 45, 7, 22]
    cache = torch.zeros(2, 64, block_size, kv_heads, dim)
    free = torch.randperm(64).tolist()
    tables, qs, ks, vs, positions, slots, expected = [], [], [], [], [], [], []
    for n, ctx in zip(query_lens, context_lens):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table + [0] * (16 - len(table)))
        keys, values, q = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim), torch.randn(n, heads, dim)
        slot = [table[t // block_size] * block_size + t % block_size for t in range(ctx)]
        cache[0].view(-1, kv_heads, dim)[slot[:ctx - n]] = keys[:ctx - n]  # cached before this step
        cache[1].view(-1, kv_heads, dim)[slot[:ctx - n]] = values[:ctx - n]
        pos = torch.arange(ctx - n, ctx)
        expected.append(reference(q, keys, values, pos, 0.25))
        qs.append(q), ks.append(keys[ctx - n:]), vs.append(values[ctx - n:]), positions.append(pos)
        slots += slot[ctx - n:]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_lens=query_lens, context_lens=context_lens,
        block_tables=torch.tensor(tables), context_lens_tensor=torch.tensor(context_lens),
        positions=torch.cat(positions))
    out = TorchAttention().forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, 0.25)
    assert (out.double() - torch.cat(expected)).abs().max() < 1e-5


def test_bf16_matmul_attention_stays_as_close_to_float32_as_flash(default_model_path, monkeypatch):
    """On the real model in bf16, a warm span prompt (rotated keys, a short question: the matmul
    path) gives first-token logprobs no further from the float32 engine's than the flash path."""
    from spanserve import LLM, SamplingParams, Span

    # ~300 tokens each: a context past BATCH_MAX_CONTEXT, so the question is a chunk of its own
    docs = [f"Document {i}. " + f"The harbour town of {name} exports {good} and hosts a {season} fair. " * 20
            for i, (name, good, season) in enumerate([("Velmont", "salt", "summer"), ("Tarholm", "wool", "winter"),
                                                      ("Kasdale", "tin", "spring"), ("Orvia", "amber", "autumn")])]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)

    def first_logprobs(llm, order):
        llm.generate([Span(d) for d in docs] + ["warm"], params)  # the spans are cached in another order
        prompt = [Span(docs[i]) for i in order] + ["Question: what does Kasdale export? Answer:"]
        return llm.generate(prompt, params)[0].outputs[0].logprobs[0]

    def distances(budget):
        monkeypatch.setattr(torch_ref, "MATMUL_MAX_SCORES", budget)
        bf16 = LLM(model=str(default_model_path), dtype="bfloat16", num_blocks=160)
        found = []
        for order, expected in zip(orders, references):
            got = first_logprobs(bf16, order)
            found.append(max(abs(got[t] - lp) for t, lp in expected.items() if t in got))
        return found

    orders = [[2, 0, 3, 1], [3, 1, 2, 0]]
    fp32 = LLM(model=str(default_model_path), dtype="float32", num_blocks=160)
    references = [first_logprobs(fp32, order) for order in orders]
    matmul, flash = distances(torch_ref.MATMUL_MAX_SCORES), distances(0)
    assert all(m < 1.5 * f + 0.05 for m, f in zip(matmul, flash)), (matmul, flash)
