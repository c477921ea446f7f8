"""Position-independent spans in the engine (tiny random models, float32).

Ported in spirit from the vLLM spans / Legolink tests (../shared/papers/vllm-spans-legolink-tests.txt),
plus exactness against transformers: a prompt with spans must give the logits of the same
tokens run through the HF model with a block-diagonal mask (span tokens see only their span)
at their real positions, whether the span's KV was computed now or reused from elsewhere.
"""

import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt, token_ids
from transformers import AutoModelForCausalLM

from spanserve import LLM, InvalidRequestError, SamplingParams, Span

CHUNK = random_prompt(32, seed=50)  # two full blocks
SUFFIX = random_prompt(9, seed=51)


def make_llm(path, **kwargs) -> LLM:
    """These tests are about span KV itself, reused as cached (link policy none): auto's focus probe,
    which recomputes a few span blocks in context, has its own tests (test_focus.py)."""
    return LLM(model=str(path), dtype="float32", **{"num_blocks": 256, "link_policy": "none", **kwargs})


@pytest.fixture
def llm(tiny_llama_path):
    """Span blocks stay shared after prefill too, so tests can see which blocks requests share
    (the private rotated copies for decode have their own tests at the end)."""
    return make_llm(tiny_llama_path, span_key_copies=False)


def spanned(prefix: list[int], chunk: list[int] = CHUNK, suffix: list[int] = SUFFIX) -> dict:
    return {"prompt_token_ids": prefix + chunk + suffix, "spans": [[len(prefix), len(prefix) + len(chunk)]]}


def prefill(llm: LLM, prompt, **params):
    """Add a request and step until its prompt is computed; it keeps its blocks until drained."""
    engine = llm.engine
    group = engine.make_group(prompt, greedy(4, **params))
    engine.add_group(group)
    req = group.children[0]
    while req.is_prefilling:
        engine.step()
    return req


def drain(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_engine_idle(llm)


def block_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def cached_ids(llm: LLM, hashes) -> list[int]:
    return [llm.engine.kv.pool.lookup(h).block_id for h in hashes]


# ---- hashing and reuse ---------------------------------------------------------------------


def warm_chunk(llm: LLM) -> list[int]:
    """Compute CHUNK as a span (after one block of padding) and return its cached block ids."""
    warm = prefill(llm, spanned([0] * 16))
    ids = block_ids(warm.block_table[1:3])
    drain(llm)
    return ids


def test_a_chunk_hashes_the_same_at_positions_16_and_48_and_both_requests_share_its_blocks(llm):
    warm_ids = warm_chunk(llm)
    a = prefill(llm, spanned(random_prompt(16, seed=1)))
    b = prefill(llm, spanned(random_prompt(48, seed=2)))  # both running at once
    assert [a.local_hashes[1], a.local_hashes[2]] == [b.local_hashes[3], b.local_hashes[4]]
    assert block_ids(a.block_table[1:3]) == block_ids(b.block_table[3:5]) == warm_ids
    assert (a.num_cached_tokens, b.num_cached_tokens) == (32, 32)
    drain(llm)


def test_a_span_boundary_resets_the_hash_chain(llm):
    tokens = random_prompt(32, seed=3) + CHUNK
    warm_id = warm_chunk(llm)[0]
    plain = prefill(llm, {"prompt_token_ids": tokens})
    plain_id = plain.block_table[2].block_id
    drain(llm)
    marked = prefill(llm, {"prompt_token_ids": tokens, "spans": [[32, 64]]})
    keys = [[llm.engine.kv._key(r, i) for i in range(4)] for r in (plain, marked)]
    assert keys[0][:2] == keys[1][:2]
    assert keys[0][2] != keys[1][2] and keys[0][3] != keys[1][3]
    # The span is cut before the prompt's last token: its one full block [32, 48) is the hit;
    # the marked run also finds the plain run's two prefix blocks.
    assert plain_id != warm_id and marked.block_table[2].block_id == warm_id
    assert marked.num_cached_tokens == 32 + 16
    drain(llm)


def test_fan_in_two_prefixes_hit_one_warm_chunk_and_keep_their_own_prefix_blocks(llm):
    warm_ids = warm_chunk(llm)
    x = prefill(llm, spanned(random_prompt(16, seed=4)))
    y = prefill(llm, spanned(random_prompt(16, seed=5)))
    assert block_ids(x.block_table[1:3]) == block_ids(y.block_table[1:3]) == warm_ids
    assert x.block_table[0].block_id != y.block_table[0].block_id
    assert (x.num_cached_tokens, y.num_cached_tokens) == (32, 32)
    drain(llm)


def test_blocks_after_a_span_are_never_shared_across_prefixes(llm):
    suffix = random_prompt(33, seed=6)  # two full blocks after the chunk, then the last token
    x = prefill(llm, spanned(random_prompt(32, seed=7), suffix=suffix))
    x_ids = block_ids(x.block_table)
    drain(llm)
    y = prefill(llm, spanned(random_prompt(32, seed=8), suffix=suffix))
    assert y.num_cached_tokens == 32  # the chunk only
    assert block_ids(y.block_table[2:4]) == x_ids[2:4]
    assert not set(block_ids(y.block_table[4:])) & set(x_ids[4:])
    drain(llm)


def test_gap_recomputes_exactly_the_head_of_the_span_and_leaves_cached_blocks_untouched(llm):
    prompt = {"prompt_token_ids": random_prompt(97, seed=9), "spans": [[32, 96]]}
    first = prefill(llm, prompt, link_policy="none")
    cached = block_ids(first.block_table[:6])
    drain(llm)
    kv = llm.engine.runner.kv_cache
    before = kv[:, :, cached].clone()
    work = record_work(llm)
    second = prefill(llm, prompt, link_policy="gap", gap_length=32)
    prefill_steps = [w for w in work if w[0] or w[1]][:1]
    assert prefill_steps == [([], [*range(32, 64), 96])]  # no span recomputed; the gap and the last token
    assert second.num_cached_tokens == 97 - 33
    assert block_ids(second.block_table[:2]) == cached[:2] and block_ids(second.block_table[4:6]) == cached[4:6]
    assert not set(block_ids(second.block_table[2:4])) & set(cached)  # the gap went to private blocks
    assert block_ids(second.shadows.values()) == cached[2:4]  # the span-local versions, still held
    drain(llm)
    assert torch.equal(kv[:, :, cached], before)


def record_work(llm: LLM) -> list[tuple[list, list]]:
    """Wrap the scheduler: every step appends ([(start, end) span chunks], [in-context token indices])."""
    scheduler, work = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        for item in batch:
            req = item.request
            chunks = [(c.start, c.end) for c in item.span_chunks]
            work.append((chunks, req.layout.in_context(req.num_computed_tokens, item.end)))
        return batch

    scheduler.schedule = recording
    return work


# ---- outputs -------------------------------------------------------------------------------


def test_spans_that_change_nothing_give_plain_outputs(tiny_llama_path):
    tokens = random_prompt(80, seed=10)
    reference = token_ids(make_llm(tiny_llama_path, enable_prefix_caching=False).generate(
        {"prompt_token_ids": tokens}, greedy(16)))
    llm = make_llm(tiny_llama_path)
    variants = [
        ({}, {}),
        ({"spans": [[0, 80]]}, {}),  # one span over the whole prompt
        ({"spans": [[0, 32]]}, {}),  # a span at 0
        ({}, {"link_policy": "gap", "gap_length": 32}),  # gap without spans
        ({"spans": [[32, 80]]}, {"link_policy": "gap", "gap_length": 64}),  # a gap covering the span
        ({"spans": [[32, 80]]}, {"link_policy": "full"}),
    ]
    for extra, params in variants * 2:  # cold, then with everything cached
        out = llm.generate({"prompt_token_ids": tokens, **extra}, greedy(16, **params))
        assert token_ids(out) == reference, (extra, params)
    assert_engine_idle(llm)


def hf_logprobs(model, tokens: list[int], spans, anchor: list[int]) -> torch.Tensor:
    """Log-probs from transformers of `tokens`, each span's tokens seeing only their span and,
    for a span not at 0, a copy of the anchor just before it. The copies go in front of the
    sequence with position ids that put them right before their span: RoPE only sees distances."""
    copies = [start for start, _ in spans if start > 0]
    a, n = len(anchor), len(tokens)
    total = a * len(copies) + n
    allowed = torch.zeros(total, total, dtype=torch.bool)
    positions = []
    for k, start in enumerate(copies):
        rows = slice(k * a, (k + 1) * a)
        allowed[rows, rows] = torch.tril(torch.ones(a, a, dtype=torch.bool))
        positions += range(start - a, start)
    base = a * len(copies)
    allowed[base:, base:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    positions += range(n)
    for start, end in spans:
        allowed[base + start:base + end, base:base + start] = False
        if start > 0:
            k = copies.index(start)
            allowed[base + start:base + end, k * a:(k + 1) * a] = True
    mask = torch.zeros(total, total).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([anchor * len(copies) + tokens]), attention_mask=mask[None, None],
                       position_ids=torch.tensor([positions])).logits[0, base:]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_path", "tiny_qwen3_path"])
@pytest.mark.parametrize("anchor", [True, False])
def test_reused_span_kv_is_exact_at_any_position(model_fixture, anchor, request):
    path = request.getfixturevalue(model_fixture)
    llm = make_llm(path, span_anchor=anchor)
    anchor_tokens = llm.engine.anchor_tokens if anchor else []
    assert bool(anchor_tokens) == anchor
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    prefixes = [random_prompt(16, seed=11), random_prompt(48, seed=12)]
    for prefix in prefixes * 2:  # computed at 16, reused at 48, then both warm
        prompt = spanned(prefix)
        out = llm.generate(prompt, params)[0]
        tokens, n = prompt["prompt_token_ids"], len(prompt["prompt_token_ids"])
        generated = out.outputs[0].token_ids
        # The engine cuts spans before the last prompt token; here the span ends well before it.
        reference = hf_logprobs(hf, tokens + generated, prompt["spans"], anchor_tokens)
        for i, top in enumerate(out.outputs[0].logprobs):
            assert int(reference[n - 1 + i].argmax()) == generated[i]
            for token, logprob in top.items():
                assert abs(reference[n - 1 + i, token].item() - logprob) < 1e-4
    assert out.num_cached_tokens == 48 + len(CHUNK)


def test_concurrent_requests_sharing_a_chunk_at_two_positions_equal_one_at_a_time(tiny_llama_path):
    prompts = [spanned(random_prompt(16 * k, seed=20 + k)) for k in (1, 3, 2)]
    alone = []
    for prompt in prompts:
        llm = make_llm(tiny_llama_path)
        alone += token_ids(llm.generate(prompt, greedy(12)))
    llm = make_llm(tiny_llama_path)
    assert token_ids(llm.generate(prompts, greedy(12))) == alone  # cold: one computes, all read
    assert token_ids(llm.generate(prompts, greedy(12))) == alone  # warm
    assert_engine_idle(llm)


def test_chunked_prefill_preemption_and_mixed_batches_do_not_change_span_outputs(tiny_llama_path):
    docs = [random_prompt(40, seed=30 + i) for i in range(3)]
    prompts = [
        [random_prompt(5, seed=40), Span_tokens(docs[0]), Span_tokens(docs[1]), random_prompt(7, seed=41)],
        [random_prompt(20, seed=42), Span_tokens(docs[1]), Span_tokens(docs[2]), random_prompt(3, seed=43)],
        [random_prompt(60, seed=44)],
    ]
    prompts = [token_prompt(parts) for parts in prompts]
    params = greedy(20, link_policy="gap", gap_length=16)
    reference = [token_ids(make_llm(tiny_llama_path).generate(p, params))[0] for p in prompts]
    for config in ({"max_num_batched_tokens": 16}, {"num_blocks": 16, "max_num_batched_tokens": 24}, {}):
        llm = make_llm(tiny_llama_path, **config)
        assert token_ids(llm.generate(prompts, params)) == reference, config
        if "num_blocks" in config:
            assert llm.engine.scheduler.num_preemptions > 0
        assert_engine_idle(llm)


class Span_tokens(list):  # noqa: N801 - reads like Span in the prompt lists above
    """A span given as token ids, for token_prompt()."""


def token_prompt(parts) -> dict:
    """Concatenate token parts, padding each Span_tokens part to whole blocks with token 0."""
    tokens, spans = [], []
    for part in parts:
        if isinstance(part, Span_tokens):
            tokens += [0] * (-len(tokens) % 16)
            start = len(tokens)
            tokens += part + [0] * (-len(part) % 16)
            spans.append([start, len(tokens)])
        else:
            tokens += part
    return {"prompt_token_ids": tokens, "spans": spans}


def test_n_siblings_share_the_span_blocks(llm):
    prompt = spanned(random_prompt(16, seed=60))
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.kv.span_hit_tokens >= 2 * len(CHUNK)  # the later siblings hit the first's chunk
    assert_engine_idle(llm)


# ---- text and chat prompts -----------------------------------------------------------------


def test_text_parts_and_chat_reuse_documents_in_any_order(llm):
    docs = ["The capital of Zorbia is Quellen. " * 6, "Mount Tarvo is 4,100 meters high. " * 5]
    first = llm.generate(["Context:\n", Span(docs[0]), Span(docs[1]), "Question: how high is Tarvo?"], greedy(4))[0]
    second = llm.generate(["Other intro:\n", Span(docs[1]), Span(docs[0]), "Question: where?"], greedy(4))[0]
    doc_tokens = sum(len(llm.get_tokenizer().encode(d)) for d in docs)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= doc_tokens - 32
    chat = llm.chat([{"role": "user", "content": [Span(docs[0]), {"type": "text", "text": docs[1], "span": True},
                                                  "How high is Tarvo?"]}], greedy(4))[0]
    assert chat.num_cached_tokens >= doc_tokens - 32
    assert_engine_idle(llm)


@pytest.mark.parametrize("spans", [[[0, 32], [16, 48]], [[0, 300]], [[32, 32]], [[8, 40]]])
def test_bad_spans_fail_the_request_and_nothing_else(llm, spans):
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": random_prompt(100, seed=70), "spans": spans}, greedy(2))
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt": "text", "spans": [[0, 16]]}, greedy(2))
    assert_engine_idle(llm)


# ---- blend (CacheBlend) ----------------------------------------------------------------------


def test_blend_recomputes_the_chosen_fraction_in_private_copies_of_the_shared_blocks(llm):
    prompt = {"prompt_token_ids": random_prompt(97, seed=80), "spans": [[16, 96]]}  # 80 independent tokens
    first = prefill(llm, prompt, link_policy="none")
    shared = block_ids(first.block_table[1:6])
    drain(llm)
    kv = llm.engine.runner.kv_cache
    before = kv[:, :, shared].clone()
    work = record_work(llm)
    req = prefill(llm, prompt, link_policy="blend", blend_ratio=0.15)
    linked = [t for t in range(16, 96) if not req.layout.independent[t]]
    assert len(linked) == 12  # ceil(0.15 * 80)
    assert [w for w in work if w[0] or w[1]] == [([], [*linked, 96])]  # the prefix block was cached too
    assert req.num_cached_tokens == 97 - 12 - 1
    private = {t // 16 for t in linked}
    for i in range(1, 6):  # private copies where tokens were linked, the shared block elsewhere
        assert (req.block_table[i].block_id in shared) == (i not in private)
        if i in private:
            own, shadow = req.block_table[i].block_id, req.shadows[i].block_id
            kept = [t % 16 for t in range(16 * i, 16 * i + 16) if req.layout.independent[t]]
            assert torch.equal(kv[:, :, own, kept], kv[:, :, shadow, kept])  # copied, not recomputed
    drain(llm)
    assert torch.equal(kv[:, :, shared], before)


def test_blend_of_every_token_equals_plain_and_blend_outputs_do_not_depend_on_the_cache(tiny_llama_path):
    tokens = random_prompt(90, seed=81)
    plain = token_ids(make_llm(tiny_llama_path).generate({"prompt_token_ids": tokens}, greedy(12)))
    llm = make_llm(tiny_llama_path)
    prompt = {"prompt_token_ids": tokens, "spans": [[16, 48], [48, 80]]}
    assert token_ids(llm.generate(prompt, greedy(12, link_policy="blend", blend_ratio=1.0))) == plain
    cold = token_ids(make_llm(tiny_llama_path).generate(prompt, greedy(12, link_policy="blend")))
    assert token_ids(llm.generate(prompt, greedy(12, link_policy="blend"))) == cold  # spans now cached
    longer = token_ids(make_llm(tiny_llama_path).generate(prompt, greedy(40, link_policy="blend")))
    small = make_llm(tiny_llama_path, num_blocks=16, max_num_batched_tokens=16)  # chunked and preempted
    assert token_ids(small.generate([prompt] * 3, greedy(40, link_policy="blend"))) == longer * 3
    assert small.engine.scheduler.num_preemptions > 0
    assert_engine_idle(small)


# ---- decode over private rotated copies of moved span keys -----------------------------------------


def test_span_key_copies_change_no_output_and_leave_the_shared_blocks_cached(tiny_llama_path):
    """Rotating the moved span keys once into private copies gives the tokens and logprobs of
    rotating the shared keys at every step (the same arithmetic, once); the shared blocks stay
    in the cache for the next request, and every block comes back at the end."""
    prompts = [spanned(random_prompt(16, seed=5)), spanned(random_prompt(48, seed=6))]
    results = {}
    for copies in (False, True):
        llm = make_llm(tiny_llama_path, span_key_copies=copies)
        warm_ids = warm_chunk(llm)
        outs = llm.generate(prompts, greedy(8, logprobs=0))
        results[copies] = [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids)]) for o in outs]
        assert_engine_idle(llm)
        req = prefill(llm, spanned(random_prompt(32, seed=7)))
        held = block_ids(req.block_table[2:4])
        assert (held != warm_ids) == copies  # private copies while it decodes, or the shared blocks
        assert cached_ids(llm, [req.local_hashes[2], req.local_hashes[3]]) == warm_ids
        drain(llm)
    (tokens, logprobs), (ref_tokens, ref_logprobs) = zip(*results[True]), zip(*results[False])
    assert tokens == ref_tokens  # on CPU the logprobs are equal too; a GPU kernel rounds its rotation apart
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-5, rtol=0)


def test_no_span_key_copies_when_the_pool_is_short(tiny_llama_path, monkeypatch):
    from spanserve.engine import llm_engine

    llm = make_llm(tiny_llama_path)
    warm_ids = warm_chunk(llm)
    monkeypatch.setattr(llm_engine, "SPAN_COPY_FREE_FRACTION", 0.99)  # as if the pool were nearly full
    req = prefill(llm, spanned(random_prompt(32, seed=8)))  # the chunk moves from 16 to 32
    assert block_ids(req.block_table[2:4]) == warm_ids
    drain(llm)
