"""Sparse decode (spanserve/sparse/): flows pick blocks, the engine attends over those only."""

from pathlib import Path

import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt

from spanserve import LLM, SamplingParams
from spanserve.attention.backend import AttentionMetadata
from spanserve.attention.torch_ref import TorchAttention
from spanserve.errors import InvalidRequestError
from spanserve.sparse import decode as decode_module
from spanserve.sparse.builtins import BUILTINS, Quest, StreamingLLM
from spanserve.sparse.decode import NARROW_FROM, SparseDecode, SparseStep
from spanserve.sparse.fields import FieldStore
from spanserve.sparse.flow import Flow, select

BS, HEADS, KV_HEADS, DIM = 16, 4, 2, 8
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)


def _decode_step(num_blocks: int, seed: int = 0):
    """A random cache [layers=1, 2, blocks, BS, KV_HEADS, DIM] and one decode query whose context
    fills `num_blocks` blocks but the last token of the last one."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(1, 2, num_blocks + 2, BS, KV_HEADS, DIM, generator=g)
    table = torch.randperm(num_blocks + 2, generator=g)[:num_blocks]
    ctx = num_blocks * BS - 3
    q = torch.randn(1, HEADS, DIM, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(table[-1]) * BS + (ctx - 1) % BS]), query_lens=[1], context_lens=[ctx],
        block_tables=table[None], context_lens_tensor=torch.tensor([ctx]), positions=torch.tensor([ctx - 1]))
    return cache, table, ctx, q, meta


def _attend(q, keys, values):
    """softmax(q k / sqrt(D)) v for one query [HEADS, DIM] over keys [L, KV_HEADS, DIM]."""
    keys, values = keys.repeat_interleave(HEADS // KV_HEADS, 1), values.repeat_interleave(HEADS // KV_HEADS, 1)
    weights = torch.einsum("hd,lhd->hl", q, keys).mul(DIM**-0.5).softmax(-1)
    return torch.einsum("hl,lhd->hd", weights, values)


def test_quest_picks_the_blocks_of_the_brute_force_bound_and_attends_over_them_only(monkeypatch):
    monkeypatch.setattr(decode_module, "NARROW_FROM", 1)  # 11 blocks, a budget of 8: the mechanics
    cache, table, ctx, q, meta = _decode_step(num_blocks=12)
    decode = SparseDecode(Quest(), budget_tokens=8 * BS, block_size=BS)
    step = SparseStep(FieldStore(cache, torch.zeros(cache.shape[2], dtype=torch.long)), {0: decode}, BS)
    narrowed = step.restrict(0, q, meta)
    # brute force: each middle block's bound, max over heads; sinks (1), recent (4) and newest kept
    keys = cache[0, 0, table]  # [12, BS, KV_HEADS, DIM]
    qg = q[0].view(KV_HEADS, HEADS // KV_HEADS, DIM)
    bound = torch.stack([
        torch.maximum(qg * keys[b].amin(0)[:, None], qg * keys[b].amax(0)[:, None]).sum(-1).max() for b in range(11)])
    middle = list(range(1, 7))  # blocks neither sink nor recent (7..10) nor newest (11)
    best = sorted(middle, key=lambda b: -bound[b])[:2]  # budget 8 = 1 sink + 4 recent + newest + 2
    expected = sorted([0, *best, 7, 8, 9, 10]) + [11]
    assert narrowed.block_tables[0, :8].tolist() == table[expected].tolist()
    assert narrowed.context_lens == [7 * BS + ctx - 11 * BS]
    new_k, new_v = (cache[0, i, table[-1], (ctx - 1) % BS][None].clone() for i in (0, 1))  # already stored
    out = TorchAttention().forward(q, new_k, new_v, cache[0], narrowed, DIM**-0.5)
    tokens = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in expected[:-1]] + [torch.arange(11 * BS, ctx)])
    flat_k, flat_v = cache[0, 0, table].flatten(0, 1), cache[0, 1, table].flatten(0, 1)
    torch.testing.assert_close(out[0], _attend(q[0], flat_k[tokens], flat_v[tokens]))


def test_a_context_under_narrow_from_budgets_stays_dense():
    """Picking blocks costs more than it saves until the context is NARROW_FROM budgets long: 11
    blocks before the newest token with a budget of 8 are attended in full, the meta unchanged."""
    cache, table, ctx, q, meta = _decode_step(num_blocks=12)
    decode = SparseDecode(Quest(), budget_tokens=8 * BS, block_size=BS)
    step = SparseStep(FieldStore(cache, torch.zeros(cache.shape[2], dtype=torch.long)), {0: decode}, BS)
    assert 11 < NARROW_FROM * 8 and step.restrict(0, q, meta) is meta


def test_a_short_prefill_chunk_attends_to_the_blocks_all_its_queries_pick(monkeypatch):
    """sparse_prefill: a 5-token chunk after 10 full blocks. Block top-k sums each block's centroid
    score over every query head of every query; the chunk's own two blocks are kept whole and each
    query still sees the chunk's keys up to its own (the causal mask moved to the shorter context)."""
    monkeypatch.setattr(decode_module, "NARROW_FROM", 1)  # 9 blocks, a budget of 7: the mechanics
    cache, table, ctx, _, meta = _decode_step(num_blocks=12, seed=3)
    ctx, chunk = 10 * BS + 3, 5  # queries at 10 BS - 2 .. 10 BS + 2: blocks 9 and 10 are their own
    q = torch.randn(chunk, HEADS, DIM, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(ctx - chunk, ctx)
    meta = AttentionMetadata(
        slot_mapping=table[positions // BS] * BS + positions % BS, query_lens=[chunk], context_lens=[ctx],
        block_tables=table[None], context_lens_tensor=torch.tensor([ctx]), positions=positions)
    decode = SparseDecode(BUILTINS["block_topk"](), budget_tokens=7 * BS, block_size=BS, prefill=True)
    assert decode.covers(chunk, samples=True) and not SparseDecode(
        BUILTINS["block_topk"](), 7 * BS, BS).covers(chunk, samples=True)
    step = SparseStep(FieldStore(cache, torch.zeros(cache.shape[2], dtype=torch.long)), {0: decode}, BS)
    narrowed = step.restrict(0, q, meta)
    keys = cache[0, 0, table]
    centroids = keys.mean(1)  # [12, KV_HEADS, DIM]
    qg = q.view(chunk, KV_HEADS, HEADS // KV_HEADS, DIM)
    score = torch.einsum("tkgd,bkd->b", qg, centroids[:9])
    best = sorted(range(1, 5), key=lambda b: -score[b])[:1]  # budget 7 = 1 sink + 4 recent (5..8) + newest + 1
    expected = sorted([0, *best, 5, 6, 7, 8]) + [9, 10]
    assert narrowed.block_tables[0, :8].tolist() == table[expected].tolist()
    assert narrowed.context_lens == [6 * BS + ctx - 9 * BS]
    assert narrowed.positions.tolist() == (positions - 3 * BS).tolist()
    assert meta.positions.tolist() == positions.tolist()  # the step's own positions are untouched
    out = TorchAttention().forward(q, keys.flatten(0, 1)[positions], cache[0, 1, table].flatten(0, 1)[positions],
                                   cache[0], narrowed, DIM**-0.5)
    flat_k, flat_v = keys.flatten(0, 1), cache[0, 1, table].flatten(0, 1)
    chosen = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in expected[:-2]])
    for j, p in enumerate(positions.tolist()):
        seen = torch.cat([chosen, torch.arange(9 * BS, p + 1)])
        torch.testing.assert_close(out[j], _attend(q[j], flat_k[seen], flat_v[seen]))


def test_select_keeps_sinks_window_and_best_scores():
    from spanserve.sparse.flow import IndexerContext

    chosen = select(torch.arange(20.0).flip(0), StreamingLLM(), IndexerContext(20, 9, 0, 0))
    assert chosen.tolist() == [0, 1, 2, 3, 16, 17, 18, 19]  # sink, the 3 best others, the window


def test_a_budget_covering_the_context_is_exact_dense_attention(llm):
    prompt = random_prompt(200, seed=1)
    dense = llm.generate({"prompt_token_ids": prompt}, greedy(8, logprobs=2))[0]
    for name in BUILTINS:
        out = llm.generate({"prompt_token_ids": prompt}, greedy(8, logprobs=2, sparse=name, sparse_budget=512))[0]
        assert out.outputs[0].token_ids == dense.outputs[0].token_ids
        assert out.outputs[0].logprobs == dense.outputs[0].logprobs
    assert_engine_idle(llm)


def test_sparse_decode_narrows_attention_and_keeps_batchmates_exact(llm):
    prompt = random_prompt(400, seed=2)
    alone = llm.generate({"prompt_token_ids": prompt}, greedy(6, logprobs=1))[0]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2,
                        [greedy(6, logprobs=1), greedy(6, logprobs=1, sparse="streaming", sparse_budget=96)])
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    sparse_lp = [max(d.values()) for d in outs[1].outputs[0].logprobs]
    dense_lp = [max(d.values()) for d in alone.outputs[0].logprobs]
    assert sparse_lp[0] == pytest.approx(dense_lp[0], abs=1e-5)  # the first token comes from the dense prefill
    assert sparse_lp[1:] != pytest.approx(dense_lp[1:], abs=1e-5)  # then 96 of 400 tokens are attended
    assert_engine_idle(llm)


def test_sparse_prefill_narrows_a_question_after_a_cached_prefix(llm):
    """Without sparse_prefill the question is computed densely (its first token's logprob is the dense
    one); with it and a budget under the context it is not; with a budget covering it, it is exact."""
    prefix, question = random_prompt(400, seed=6), random_prompt(10, seed=7)
    llm.generate({"prompt_token_ids": prefix}, greedy(1))  # cached: the question is a 10-token chunk
    prompt = {"prompt_token_ids": prefix + question}
    dense = llm.generate(prompt, greedy(4, logprobs=1))[0].outputs[0]
    narrow, covering = {"sparse": "streaming", "sparse_budget": 96}, {"sparse": "block_topk", "sparse_budget": 512}
    outs = llm.generate([prompt] * 3, [greedy(4, logprobs=1, **narrow),
                                       greedy(4, logprobs=1, **narrow, sparse_prefill=True),
                                       greedy(4, logprobs=1, **covering, sparse_prefill=True)])
    first = [max(out.outputs[0].logprobs[0].values()) for out in outs]
    assert first[0] == pytest.approx(max(dense.logprobs[0].values()), abs=1e-5)
    assert first[1] != pytest.approx(first[0], abs=1e-4)
    assert outs[2].outputs[0].token_ids == dense.token_ids and outs[2].outputs[0].logprobs == dense.logprobs
    with pytest.raises(InvalidRequestError, match="sparse_prefill needs a sparse flow"):
        SamplingParams(sparse_prefill=True)
    assert_engine_idle(llm)


class _Raises(Flow):
    name = "raises"

    def forward_indexer(self, q, fields, state, ctx):
        raise RuntimeError("boom")


class _FieldsRaise(Flow):
    name = "fields_raise"

    def create_cache(self):
        return {"centroid": (-1,)}

    def forward_cache(self, keys, values):
        raise RuntimeError("no fields")


class _OutOfRange(Flow):
    name = "out_of_range"

    def forward_indexer(self, q, fields, state, ctx):
        return torch.tensor([ctx.num_blocks + 5])


class _PicksIntoTooMany(Flow):
    """Writes its table row itself (pick_into), then claims more blocks than the budget allows."""

    name = "picks_into_too_many"

    def pick_into(self, q, store, layer, block_ids, own, table, state, ctx):
        table.fill_(0)
        return ctx.budget_blocks


@pytest.mark.parametrize("flow, message", [(_Raises, "boom"), (_FieldsRaise, "no fields"),
                                           (_OutOfRange, "must be in"), (_PicksIntoTooMany, "the budget allows")])
def test_a_failing_flow_ends_its_request_only(tiny_llama_path, flow, message):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    llm.engine.sparse_flows[flow.name] = flow()
    prompt = random_prompt(400, seed=3)  # 25 blocks: over 4 budgets of 96 tokens, so it narrows
    alone = llm.generate({"prompt_token_ids": prompt}, greedy(5))[0]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [greedy(5), greedy(5, sparse=flow.name, sparse_budget=96)])
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "error" and message in outs[1].outputs[0].stop_reason
    assert_engine_idle(llm)


def test_a_flow_failing_after_writing_its_row_leaves_that_row_whole_beside_a_narrowed_one(monkeypatch):
    """Two sequences in one step: the first's flow writes its table row, then fails (a count over
    its budget); the second narrows. The step's tables hold the first's row as it was, with its
    whole context, and the second's picks; the first ends with the error after the step."""
    monkeypatch.setattr(decode_module, "NARROW_FROM", 1)
    cache, table, ctx, q, _ = _decode_step(num_blocks=12)
    q2 = torch.cat([q, q])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(table[-1]) * BS + (ctx - 1) % BS] * 2), query_lens=[1, 1],
        context_lens=[ctx, ctx], block_tables=torch.stack([table, table]),
        context_lens_tensor=torch.tensor([ctx, ctx]), positions=torch.tensor([ctx - 1, ctx - 1]))
    failing = SparseDecode(_PicksIntoTooMany(), budget_tokens=8 * BS, block_size=BS)
    narrowing = SparseDecode(BUILTINS["block_topk"](), budget_tokens=8 * BS, block_size=BS)
    store = FieldStore(cache, torch.zeros(cache.shape[2], dtype=torch.long))
    narrowed = SparseStep(store, {0: failing, 1: narrowing}, BS).restrict(0, q2, meta)
    assert narrowed.block_tables[0].tolist() == table.tolist() and narrowed.context_lens[0] == ctx
    assert narrowed.context_lens[1] == 7 * BS + ctx - 11 * BS and narrowed.block_tables[1, 7] == table[11]
    assert "the budget allows" in failing.error and narrowing.error is None


def test_bad_sparse_requests_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="unknown sparse flow 'nope'; available: block_topk"):
        llm.generate("hi", SamplingParams(sparse="nope"))
    with pytest.raises(InvalidRequestError, match="sparse_budget 64 is smaller"):
        llm.generate("hi", SamplingParams(sparse="quest", sparse_budget=64))
    with pytest.raises(InvalidRequestError, match="cannot load sparse flow"):
        LLM(model="/unused", sparse_flows=["no.such.Flow"])


def test_a_user_flow_loads_by_dotted_path(tiny_llama_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256,
              sparse_flows=["examples.sparse_flow.PeakHead"])
    prompt = {"prompt_token_ids": random_prompt(300, seed=4)}
    out = llm.generate(prompt, greedy(4, sparse="peak_head", sparse_budget=64))
    assert out[0].outputs[0].finish_reason == "length"
    assert len((ROOT / "examples/sparse_flow.py").read_text().splitlines()) <= 30


def _fields(store, flow, layer, ids):
    """`flow`'s fields of blocks `ids` at `layer`, as a step reads them: refreshed, then read."""
    store.refresh(flow, ids)
    return store.read(flow, layer, ids)


def test_fields_are_computed_once_per_block_and_layer_and_again_after_a_rewrite():
    """A step refreshes a sequence's blocks once for all layers; each layer then only reads."""
    cache = torch.randn(3, 2, 4, BS, KV_HEADS, DIM)
    generation = torch.zeros(4, dtype=torch.long)
    store, flow, calls = FieldStore(cache, generation), Quest(), []
    original = flow.forward_cache
    flow.forward_cache = lambda k, v: calls.append(len(k)) or original(k, v)
    ids = torch.tensor([0, 2])
    first = _fields(store, flow, 1, ids)
    again = _fields(store, flow, 1, ids)
    assert calls == [6] and torch.equal(first["kmax"], again["kmax"])  # both blocks at the 3 layers, at once
    for layer in range(3):
        torch.testing.assert_close(store.read(flow, layer, ids)["kmin"], cache[layer, 0, ids].amin(1))
    torch.testing.assert_close(first["kmax"], cache[1, 0, ids].amax(1))
    cache[:, 0, 2] += 1.0
    generation[2] += 1  # the pool saw it rewritten
    assert calls == [6] and torch.equal(_fields(store, flow, 1, ids)["kmax"][1], cache[1, 0, 2].amax(0))
    assert calls == [6, 3]
    torch.testing.assert_close(store.read(flow, 2, ids)["kmin"], cache[2, 0, ids].amin(1))  # each layer's own


def test_a_large_refresh_is_cut_into_calls_of_at_most_refresh_blocks(monkeypatch):
    """A session's first question refreshes thousands of blocks at every layer: their keys are
    copied out for forward_cache a bounded number at a time."""
    from spanserve.sparse import fields

    monkeypatch.setattr(fields, "REFRESH_BLOCKS", 4)
    cache = torch.randn(3, 2, 4, BS, KV_HEADS, DIM)
    store, flow, calls = FieldStore(cache, torch.zeros(4, dtype=torch.long)), Quest(), []
    original = flow.forward_cache
    flow.forward_cache = lambda k, v: calls.append(len(k)) or original(k, v)
    ids = torch.tensor([3, 1])
    store.refresh(flow, ids)
    assert calls == [4, 2]  # layers 0-1, then layer 2
    for layer in range(3):
        torch.testing.assert_close(store.read(flow, layer, ids)["kmax"], cache[layer, 0, ids].amax(1))


def test_flows_with_the_same_cache_stage_share_its_fields():
    cache = torch.randn(2, 2, 4, BS, KV_HEADS, DIM)
    store, ids = FieldStore(cache, torch.zeros(4, dtype=torch.long)), torch.tensor([1, 3])
    topk, h2o, calls = BUILTINS["block_topk"](), BUILTINS["h2o"](), []
    first = _fields(store, topk, 0, ids)
    h2o.forward_cache = lambda k, v: calls.append(len(k)) or {}
    assert torch.equal(_fields(store, h2o, 0, ids)["centroid"], first["centroid"]) and calls == []
    assert len(store.fields) == 1 and set(_fields(store, Quest(), 0, ids)) == {"kmin", "kmax"}


def test_every_flow_runs_in_bfloat16(tiny_llama_path):
    """Fields are kept in the cache's dtype; the flows read them as float32 (a bf16 engine once failed
    every flow whose indexer mixed the two in an einsum)."""
    llm = LLM(model=str(tiny_llama_path), dtype="bfloat16", num_blocks=128)
    for name in BUILTINS:
        out = llm.generate({"prompt_token_ids": random_prompt(400, seed=5)}, greedy(3, sparse=name, sparse_budget=96))
        assert out[0].outputs[0].finish_reason == "length", (name, out[0].outputs[0].stop_reason)
    assert_engine_idle(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_topk_picks_in_c_what_it_picks_in_torch(dtype):
    """BlockTopK reads its centroids in place in one C call (kernels/csrc/block_pick.c) and writes the
    block table's row; its picks are the torch path's (forward_indexer over the fields read out,
    the queries folded by KV head), sinks and window included, the step's own blocks after them.
    The queries are rows of a wider tensor, as when RoPE ran in torch on the qkv projection's views."""
    from spanserve.attention.torch_ref import fold_query_heads
    from spanserve.kernels import cpu_kernel
    from spanserve.sparse.flow import IndexerContext

    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 2, 40, BS, KV_HEADS, DIM, generator=gen).to(dtype)
    store, flow = FieldStore(cache, torch.zeros(40, dtype=torch.long)), BUILTINS["block_topk"]()
    ids, own = torch.randperm(40, generator=gen)[:30], torch.tensor([37, 38])
    store.refresh(flow, ids)
    qkv = torch.randn(3, HEADS + 2 * KV_HEADS, DIM, generator=gen).to(dtype)  # a bf16 model's queries
    q = qkv[:, :HEADS]
    for budget, num in ((9, 30), (12, 30), (6, 30), (9, 7), (9, 3)):
        ctx, table = IndexerContext(num, budget, 1, 1), torch.full((34,), -1)
        chosen = flow.pick_into(q, store, 1, ids[:num], own, table, {}, ctx)
        reference = flow.forward_indexer(fold_query_heads(q, KV_HEADS), store.read(flow, 1, ids[:num]), {}, ctx)
        assert chosen == len(reference), (budget, num)
        assert table[:chosen + 2].tolist() == [*ids[reference].tolist(), 37, 38], (budget, num)
        assert (table[chosen + 2:] == -1).all()
    assert cpu_kernel.centroid_topk(store.layer_field(flow, 1, "centroid"), ids, own, q.float(), 1, 4, 8,
                                    torch.zeros(32, dtype=torch.int32)) is None  # not int64: the torch path
    with pytest.raises(ValueError, match="cannot hold 30 blocks and 2 more"):
        cpu_kernel.centroid_topk(store.layer_field(flow, 1, "centroid"), ids, own, q, 1, 4, 8, torch.zeros(31).long())


def test_a_block_topk_subclass_with_its_own_indexer_runs_it():
    """The C picks stand in for BlockTopK's own forward_indexer only: a subclass's runs as written."""
    from spanserve.sparse.flow import IndexerContext

    class Last(BUILTINS["block_topk"]):
        name = "last_blocks"

        def forward_indexer(self, q, fields, state, ctx):
            return torch.arange(ctx.num_blocks - ctx.budget_blocks + 1, ctx.num_blocks)

    cache = torch.randn(1, 2, 40, BS, KV_HEADS, DIM)
    store, flow, ids = FieldStore(cache, torch.zeros(40, dtype=torch.long)), Last(), torch.arange(30)
    store.refresh(flow, ids)
    q, ctx = torch.randn(1, HEADS, DIM), IndexerContext(30, 9, 0, 1)
    assert flow.pick_into(q, store, 0, ids, torch.tensor([31]), torch.zeros(31, dtype=torch.long), {}, ctx) is None
    folded = q.view(KV_HEADS, HEADS // KV_HEADS, DIM)
    assert flow.pick_blocks(folded, store, 0, ids, {}, ctx).tolist() == list(range(22, 30))
