"""Training-free link policies against dense references: CacheBlend's layer-by-layer selection
and APE's reweighted attention (tiny random models, float32).

The references run the HF model's own layers on plain tensors with an explicit attention
(every key a query may read, and which version of its KV, spelled out), so they share no code
with the engine's probe, paged cache, key rotation or attention paths.
"""

import math

import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import rotate_half

from spanserve import LLM, InvalidRequestError, SamplingParams
from spanserve.attention import AttentionMetadata, KeyRotation, SpanShare, TorchAttention, torch_ref
from spanserve.pic.link import LinkPolicy

# A prefix, a span whose end is not on a block boundary, text between the spans, a second span,
# a suffix: the probe must read the text between as it will be, and never write the span's
# partial last block.
SPANS = [[16, 40], [48, 80]]
NUM_TOKENS = 90


def make_llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", **{"num_blocks": 256, **kwargs})


def prompt(seed: int) -> dict:
    return {"prompt_token_ids": random_prompt(NUM_TOKENS, seed=seed), "spans": SPANS}


def span_tokens() -> list[int]:
    return [t for start, end in SPANS for t in range(start, end)]


def load_hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ---- the dense model -------------------------------------------------------------------------


class Dense:
    """The HF model's layers on plain tensors: rows of hidden states at explicit positions."""

    def __init__(self, hf):
        self.model, self.lm_head = hf.model, hf.lm_head
        cfg = hf.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.embed_tokens(torch.tensor(ids))

    def qkv(self, layer: int, h: torch.Tensor, positions: list[int]):
        """This layer's q [R, heads, D], k and v [R, kv_heads, D] of rows h, RoPE at `positions`."""
        block = self.model.layers[layer]
        attn, x = block.self_attn, block.input_layernorm(h)
        q, k, v = (proj(x).view(len(h), -1, self.head_dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.model.rotary_emb(h, torch.tensor([positions]))
        cos, sin = cos[0][:, None], sin[0][:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, layer: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: output projection, residuals, MLP."""
        block = self.model.layers[layer]
        h = h + block.self_attn.o_proj(attended.flatten(1))
        return h + block.mlp(block.post_attention_layernorm(h))

    def logprobs(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.lm_head(self.model.norm(h)), -1)


def scores_of(q, k):
    """[heads, Q, L] scaled dot products, the kv heads shared by their query groups."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])


def weighted_values(probs, v, heads):
    return torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(heads // v.shape[1], 1))


def attention(q, k, v, allowed):
    """Plain softmax attention, query i reading the keys allowed[i]."""
    probs = scores_of(q, k).masked_fill(~allowed, float("-inf")).softmax(-1)
    return weighted_values(probs, v, q.shape[1])


def ape_attention(q, k, v, allowed, span, temperature, scale):
    """APE as its authors compute it: span keys and the others attended apart (span scores over
    the temperature), the two results merged by their log-sum-exps, the spans' times scale * T."""
    scores = scores_of(q, k)

    def part(mask, divisor):
        masked = (scores / divisor).masked_fill(~mask, float("-inf"))
        out = weighted_values(masked.softmax(-1).nan_to_num(0.0), v, q.shape[1])
        return out, torch.logsumexp(masked, -1).T[..., None]  # [Q, heads, 1]

    out_span, lse_span = part(allowed & span[None], temperature)
    out_other, lse_other = part(allowed & ~span[None], 1.0)
    weights = torch.stack([scale * temperature * lse_span, lse_other]).softmax(0)
    return weights[0] * out_span + weights[1] * out_other


def hf_kv(hf, ids: list[int], positions: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K (after RoPE) and V [len, kv_heads, D] of ids run by transformers."""
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=True)
    cache = out.past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


# ---- CacheBlend ------------------------------------------------------------------------------


def test_blend_keeps_a_shrinking_fraction_at_each_check_layer():
    policy = LinkPolicy("blend", blend_ratio=0.2, blend_layers=3)
    assert policy.blend_counts(56, 3) == [33, 20, 12]  # ceil(56 * 0.2 ** (l / 3))
    assert policy.blend_counts(56, 1) == [12]  # a model with two layers has one check layer
    assert LinkPolicy("blend", blend_ratio=1.0, blend_layers=2).blend_counts(10, 5) == [10, 10]
    assert LinkPolicy("blend", blend_ratio=0.01, blend_layers=2).blend_counts(10, 5) == [1, 1]


def change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return (new - old).pow(2).sum((1, 2)) / old.pow(2).sum((1, 2)).mean()


def reference_blend(hf, tokens: list[int], anchor: list[int], ratio: float, checks: int) -> list[int]:
    """CacheBlend's gradual filtering, densely. Keys nobody recomputes are the prefix computed in
    context and each span computed alone after the anchor, at its real positions; at each layer
    the picked span tokens and the text between the spans are recomputed over them."""
    dense, a = Dense(hf), len(anchor)
    picks = span_tokens()
    last, first = picks[-1], SPANS[0][0]
    between = [t for t in range(first, last + 1) if t not in picks]
    shape = (last + 1, hf.config.num_key_value_heads, dense.head_dim)
    kv = [[torch.zeros(shape), torch.zeros(shape)] for _ in dense.model.layers]
    for ids, positions, dest in [(tokens[:first], range(first), range(first))] + [
            (anchor + tokens[s:e], range(s - a, e), range(s, e)) for s, e in SPANS]:
        for (keys, values), (k, v) in zip(kv, hf_kv(hf, ids, list(positions))):
            keys[dest.start:dest.stop], values[dest.start:dest.stop] = k[-len(dest):], v[-len(dest):]
    n = len(picks)
    counts = [min(n, max(math.ceil(ratio * n), math.ceil(ratio ** (c / checks) * n))) for c in range(1, checks + 1)]
    rows = sorted(picks + between)
    h = dense.embed([tokens[t] for t in rows])
    for layer, keep in enumerate(counts):
        q, k, v = dense.qkv(layer, h, rows)
        keys, values = kv[layer][0].clone(), kv[layer][1].clone()
        keys[rows], values[rows] = k, v
        allowed = torch.arange(last + 1)[None, :] <= torch.tensor(rows)[:, None]
        h = dense.finish(layer, h, attention(q, keys, values, allowed))
        _, k_next, v_next = dense.qkv(layer + 1, h[[rows.index(t) for t in picks]], picks)
        deviation = (change(k_next, kv[layer + 1][0][picks]) + change(v_next, kv[layer + 1][1][picks])).tolist()
        order = sorted(range(len(picks)), key=lambda i: -deviation[i])
        if keep < len(picks):  # a clear cut, or float noise between two paths could flip it
            assert deviation[order[keep - 1]] - deviation[order[keep]] > 1e-4 * deviation[order[keep - 1]]
        picks = sorted(picks[i] for i in order[:keep])
        kept = [i for i, t in enumerate(rows) if t in picks or t in between]
        rows, h = [rows[i] for i in kept], h[kept]
    return picks


def prefilled_kv(llm: LLM, prompt: dict, **params):
    """Prefill `prompt`; returns its span tokens still read from their span KV after linking,
    and every layer's K/V of all span tokens as its context view holds them."""
    engine, bs = llm.engine, llm.engine.config.block_size
    group = engine.make_group(prompt, greedy(2, **params))  # still running after its prefill
    engine.add_group(group)
    req = group.children[0]
    while req.is_prefilling:
        engine.step()
    independent = [t for t in span_tokens() if req.layout.independent[t]]
    slots = [req.block_table[t // bs].block_id * bs + t % bs for t in span_tokens()]
    kv = engine.runner.kv_cache.flatten(2, 3)[:, :, slots].clone()
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(llm)
    return independent, kv


def engine_blend(llm: LLM, prompt: dict, **params) -> list[int]:
    """The span tokens blend links; checks that the others keep their span KV as computed alone."""
    independent, kv = prefilled_kv(llm, prompt, link_policy="blend", **params)
    _, alone = prefilled_kv(llm, prompt, link_policy="none")
    kept = [span_tokens().index(t) for t in independent]
    torch.testing.assert_close(kv[:, :, kept], alone[:, :, kept], rtol=1e-5, atol=1e-5)
    return [t for t in span_tokens() if t not in independent]


@pytest.mark.parametrize("seed", [7, 8])
def test_blend_links_exactly_the_tokens_a_dense_layer_by_layer_filter_picks(tiny_llama4_path, seed):
    hf, llm = load_hf(tiny_llama4_path), make_llm(tiny_llama4_path)
    tokens, anchor = prompt(seed)["prompt_token_ids"], llm.engine.anchor_tokens
    with torch.no_grad():
        expected = {checks: reference_blend(hf, tokens, anchor, 0.2, checks) for checks in (1, 2, 3)}
    assert expected[3] != expected[1] and expected[2] != expected[1]  # filtering changes the picks here
    for checks in (3, 1, 2, 3):  # the last one with the spans cached
        assert engine_blend(llm, prompt(seed), blend_ratio=0.2, blend_layers=checks) == expected[checks], checks
    # More check layers than the model has second-to-last layers: as many as it has.
    assert engine_blend(llm, prompt(seed), blend_ratio=0.2, blend_layers=9) == expected[3]


# ---- APE -------------------------------------------------------------------------------------


def fill_cache(contexts: list[int], kv_heads: int, dim: int, block_size: int = 16):
    """A paged cache holding random K/V for sequences of the given context lengths, each in its
    own blocks (in reverse order: not contiguous), and their block tables."""
    num_blocks = sum(-(-n // block_size) for n in contexts) + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    tables, free = [], list(range(num_blocks - 1, 0, -1))
    for n in contexts:
        tables.append([free.pop(0) for _ in range(-(-n // block_size))][::-1])
    return cache, tables


def test_ape_attention_matches_the_two_part_formula_on_every_path():
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 16
    temperature, scale = 0.6, 0.7
    # (context length, queries): a decode token, a short prefill chunk, a long one
    seqs = [(40, 1), (30, 5), (300, 100)]
    cache, tables = fill_cache([n for n, _ in seqs], kv_heads, dim, bs)
    spans = [torch.rand(n) < 0.5 for n, _ in seqs]
    queries = [torch.randn(q, heads, dim) for _, q in seqs]
    spans[2][250:] = False  # span keys end before the context does

    def run(chosen: list[int]) -> list[torch.Tensor]:
        slots, positions, shares, rotations = [], [], [], []
        for i in chosen:
            n, q = seqs[i]
            positions += range(n - q, n)
            slots += [tables[i][p // bs] * bs + p % bs for p in range(n - q, n)]
            factors = torch.where(spans[i], 1 / temperature, 1.0)[:, None]  # the temperature, in the keys
            rotations.append(KeyRotation.from_angles(factors.expand(n, dim // 2), torch.zeros(n, dim // 2), kv_heads))
            shares.append(SpanShare(spans[i], scale * temperature))
        width = max(len(tables[i]) for i in chosen)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_lens=[seqs[i][1] for i in chosen],
            context_lens=[seqs[i][0] for i in chosen],
            block_tables=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in chosen]),
            context_lens_tensor=torch.tensor([seqs[i][0] for i in chosen]), positions=torch.tensor(positions),
            key_rotation=rotations, span_share=shares)
        flat = cache.view(2, -1, kv_heads, dim)
        out = TorchAttention().forward(torch.cat([queries[i] for i in chosen]), flat[0][slots], flat[1][slots],
                                       cache, meta, dim**-0.5)
        return list(out.split([seqs[i][1] for i in chosen]))

    expected = []
    for (n, q), span, table, query in zip(seqs, spans, tables, queries):
        k, v = (part[table].flatten(0, 1)[:n] for part in cache)
        allowed = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
        expected.append(ape_attention(query, k, v, allowed, span, temperature, scale))
    calls = []
    share_spans = torch_ref._share_spans
    torch_ref._share_spans = lambda scores, *args: calls.append(scores.dim()) or share_spans(scores, *args)
    try:
        together = run([0, 1, 2])  # the two short ones batched, the long one alone
        alone = [run([i])[0] for i in range(3)]
    finally:
        torch_ref._share_spans = share_spans
    assert 4 in calls and 3 in calls  # the batched and the matmul paths both reweighted
    for got, ref in zip(together + alone, expected * 2):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def dense_ape_logprobs(hf, tokens: list[int], anchor: list[int], temperature: float, scale: float) -> torch.Tensor:
    """Log-probs of `tokens` with each span's tokens seeing only their anchor copy and their
    span, and every other token reading span keys the APE way (ape_attention)."""
    dense, a, n = Dense(hf), len(anchor), len(tokens)
    base = a * len(SPANS)
    total = base + n
    allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
    allowed[:, :base] = False
    positions, span_key = [], torch.zeros(total, dtype=torch.bool)
    for c, (start, end) in enumerate(SPANS):
        copy, rows = slice(c * a, (c + 1) * a), slice(base + start, base + end)
        allowed[copy, copy] = torch.tril(torch.ones(a, a, dtype=torch.bool))
        allowed[rows, base:base + start] = False
        allowed[rows, copy] = True
        positions += range(start - a, start)
        span_key[rows] = True
    positions += range(n)
    in_context = ~span_key
    in_context[:base] = False
    h = dense.embed(anchor * len(SPANS) + tokens)
    for layer in range(len(dense.model.layers)):
        q, k, v = dense.qkv(layer, h, positions)
        out = attention(q, k, v, allowed)
        out[in_context] = ape_attention(q[in_context], k, v, allowed[in_context], span_key, temperature, scale)
        h = dense.finish(layer, h, out)
    return dense.logprobs(h[base:])


def assert_matches_dense(out, hf, tokens, anchor, temperature, scale):
    generated, n = out.outputs[0].token_ids, len(tokens)
    with torch.no_grad():
        reference = dense_ape_logprobs(hf, tokens + generated, anchor, temperature, scale)
    for i, top in enumerate(out.outputs[0].logprobs):
        assert int(reference[n - 1 + i].argmax()) == generated[i]
        for token, logprob in top.items():
            assert abs(reference[n - 1 + i, token].item() - logprob) < 1e-4


@pytest.mark.parametrize("model_fixture", ["tiny_llama4_path", "tiny_qwen3_path"])
def test_ape_outputs_match_a_dense_reference_alone_batched_chunked_and_cached(model_fixture, request):
    path = request.getfixturevalue(model_fixture)
    hf = load_hf(path)
    temperature, scale = 0.5, 0.8
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, link_policy="ape",
                            ape_temperature=temperature, ape_scale=scale)
    prompts = [prompt(20), prompt(21)]
    for config in ({}, {"max_num_batched_tokens": 16}):
        llm = make_llm(path, **config)
        anchor = llm.engine.anchor_tokens
        for batch in ([prompts[0]], prompts, prompts):  # alone, then two at once: cold, then warm
            for p, out in zip(batch, llm.generate(batch, params)):
                assert_matches_dense(out, hf, p["prompt_token_ids"], anchor, temperature, scale)
        assert llm.engine.kv.span_hit_tokens > 0
        assert_engine_idle(llm)


def test_ape_at_temperature_and_scale_one_is_plain_span_attention(tiny_llama_path):
    llm = make_llm(tiny_llama_path)
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 3}
    plain = llm.generate(prompt(22), SamplingParams(**params, link_policy="none"))[0].outputs[0]
    ape = llm.generate(prompt(22), SamplingParams(**params, link_policy="ape", ape_temperature=1.0,
                                                  ape_scale=1.0))[0].outputs[0]
    assert ape.token_ids == plain.token_ids
    for mine, theirs in zip(ape.logprobs, plain.logprobs):
        assert all(abs(mine[t] - theirs[t]) < 1e-5 for t in theirs)


def test_ape_blocks_after_the_spans_are_not_shared_with_other_policies_or_settings(tiny_llama_path):
    llm = make_llm(tiny_llama_path)
    context_keys, span_keys = [], []
    for params in ({"link_policy": "none"}, {"link_policy": "ape"}, {"link_policy": "ape", "ape_scale": 0.5},
                   {"link_policy": "ape", "ape_temperature": 0.5}):
        req = llm.engine.make_group(prompt(23), greedy(1, **params)).children[0]
        llm.engine.kv._hash(req)
        context_keys.append(req.block_hashes[2])  # the first span's end and the text after it
        span_keys.append(tuple(req.local_hashes.values()))
    assert len(set(context_keys)) == 4
    assert len(set(span_keys)) == 1  # the spans' own KV is the same: shared by all of them


@pytest.mark.parametrize("fields", [
    {"link_policy": "ape", "ape_temperature": 0}, {"ape_temperature": 1.5}, {"ape_scale": -0.1},
    {"ape_scale": True}, {"blend_layers": 0}, {"link_policy": "cacheblend"},
])
def test_bad_policy_settings_are_invalid_requests(fields):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**fields)
