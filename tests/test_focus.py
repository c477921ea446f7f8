"""focus_spans: a probe of the question over the cached spans picks the spans it reads most, and
those are recomputed in context (pic/link.py, engine/runner.py focus_select).

The reference is written apart from the engine: a dense forward of the prompt with every span
cached (spanserve/comb/dense.py) whose attention weights are summed by hand, then the dense
forward with the picked span moved into context."""

import numpy as np
import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt
from test_comb import HEAD, QUESTION, make_llm, random_plugin, run

from spanserve import InvalidRequestError, SamplingParams
from spanserve.comb import dense
from spanserve.comb.plugin import CombPlugin
from spanserve.kernels import cpu_kernel
from spanserve.pic.focus import focus_blocks

WATCHED = 8  # the probe's question rows (engine/runner.py FOCUS_ROWS)
# Documents of one length: a span's score must not follow from its length.
DOCS = [random_prompt(32, seed=70 + i) for i in range(3)]


# Documents of four blocks (HEAD is one block): room for a window of blocks inside one.
LONG_DOCS = [random_prompt(64, seed=80 + i) for i in range(3)]


def prompt(order: list[int], docs: list[list[int]] = DOCS) -> dict:
    ids, spans = list(HEAD), []
    for i in order:
        spans.append([len(ids), len(ids) + len(docs[i])])
        ids += docs[i]
    return {"prompt_token_ids": ids + QUESTION, "spans": spans}


@pytest.fixture(scope="module")
def plugin_file(tiny_llama_path, tmp_path_factory):
    """A random plug-in with reader deltas: the probe must read through them too."""
    path = tmp_path_factory.mktemp("focus") / "plugin.safetensors"
    random_plugin(make_llm(tiny_llama_path), seed=3).save(path)
    return path


def key_attention(engine, plugin, p: dict) -> torch.Tensor:
    """[layers, heads, watched, keys]: the attention weight the last WATCHED context tokens after
    the first span (the question) give each key of the prompt in each layer and head, with every
    span read from its cached (span-local) KV."""
    model = engine.runner.model
    layout = dense.DenseLayout.for_engine(engine, p["prompt_token_ids"], p["spans"])
    n = len(layout.token_ids)
    independent = torch.zeros(n, dtype=torch.bool)
    for start, end, _ in layout.spans:
        independent[start:end] = True
    context, span_idx = (~independent).nonzero()[:, 0], independent.nonzero()[:, 0]
    encoded = dense.encode_spans(model, plugin, layout)
    x = model.embed_tokens(torch.tensor(layout.token_ids)[context])
    causal = torch.arange(n)[None, :] <= context[:, None]
    readers = (context >= layout.spans[0][0]).nonzero()[:, 0]
    watched = readers[-WATCHED:]
    out = torch.zeros(len(model.layers), model.cfg.num_heads, len(watched), n)
    with plugin.active(None, readers) if plugin else torch.no_grad():
        for i, (layer, (span_k, span_v)) in enumerate(zip(model.layers, encoded)):
            q, k, _, v = dense._project(layer, x, context)
            keys, values = k.new_empty(n, *k.shape[1:]), v.new_empty(n, *v.shape[1:])
            keys[context], values[context] = k, v
            _, keys[span_idx] = layer.self_attn.rope(span_idx, span_k[:, :1], span_k)
            values[span_idx] = span_v
            group = q.shape[1] // keys.shape[1]
            scores = torch.einsum("qhd,khd->hqk", q[watched], keys.repeat_interleave(group, 1))
            weights = (scores * layer.self_attn.scale).masked_fill(~causal[watched], float("-inf")).softmax(-1)
            out[i] = weights
            x = dense._finish_layer(layer, x, dense._attend(layer, q[None], keys[None], values[None], causal[None])[0])
    return out


def by_span(weights: torch.Tensor, spans: list) -> torch.Tensor:
    """[..., spans]: per-key weights summed over each span's keys."""
    return torch.stack([weights[..., start:end].sum(-1) for start, end in spans], -1)


def voting(weights: torch.Tensor, pairs: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """[voters, watched, keys]: the (layer, head) pairs whose attention picks the spans, in order;
    by default every head of the layers from a third to five sixths of the model (pic/voters.py),
    at least one."""
    if pairs is None:
        first = len(weights) // 3
        return weights[first:max(first + 1, 5 * len(weights) // 6)].flatten(0, 1)
    return torch.stack([weights[layer, head] for layer, head in sorted(pairs)])


def reference(engine, plugin, p: dict, in_context: set[int], generated: list[int],
              linked: tuple[int, ...] = ()) -> torch.Tensor:
    """Dense logprobs of `generated` with the spans in `in_context` and the span tokens `linked`
    computed in context."""
    spans = [s for i, s in enumerate(p["spans"]) if i not in in_context]
    ids = p["prompt_token_ids"] + generated
    layout = dense.DenseLayout.for_engine(engine, ids, spans)
    layout.linked = linked
    first = len(p["prompt_token_ids"]) - 1
    logits = dense.forward(engine.runner.model, plugin, layout, list(range(first, len(ids) - 1)),
                           readers_from=p["spans"][0][0])  # (the engine's request keeps its first span)
    return logits.log_softmax(-1)[torch.arange(len(generated)), generated]


def logprobs(out, tokens) -> torch.Tensor:
    return torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)])


@pytest.fixture(scope="module")
def peaked_plugin(tiny_llama4_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("focus4") / "plugin.safetensors"
    random_plugin(make_llm(tiny_llama4_path), seed=3).save(path)
    return path


@pytest.mark.parametrize("policy, scores", [("none", "C kernel"), ("comb", "C kernel"), ("none", "torch")])
def test_focus_recomputes_in_context_the_span_the_question_reads_most(tiny_llama4_path, peaked_plugin, policy,
                                                                      scores, monkeypatch):
    """On a model whose attention is peaked (near-uniform attention would favour the longest span
    whatever the question), over several orders: the pick is the span the reference scores highest.
    The probe's scores come from the C kernel where it runs, else from torch (GPUs)."""
    if scores == "torch":
        monkeypatch.setattr(cpu_kernel, "paged_scores", lambda *args: None)
    llm = make_llm(tiny_llama4_path, comb_plugin=str(peaked_plugin))
    plugin = llm.engine.comb if policy == "comb" else None
    picks, probed, probe = [], [], llm.engine.runner.focus_weights
    llm.engine.runner.focus_weights = lambda req: probed.append(probe(req)) or probed[-1]
    for order in ([2, 0, 1], [0, 1, 2], [1, 2, 0], [0, 2, 1]):
        p = prompt(order)
        with torch.no_grad():
            expected = voting(key_attention(llm.engine, plugin, p))
            picked = int(by_span(expected.sum((0, 1)), p["spans"]).argmax())
            out, tokens = run(llm, p, link_policy=policy, focus_spans=1)
            torch.testing.assert_close(probed.pop(), expected, atol=1e-4, rtol=1e-4)  # per layer and row
            ours = logprobs(out, tokens)
            torch.testing.assert_close(ours, reference(llm.engine, plugin, p, {picked}, tokens), atol=1e-4, rtol=0)
            for other in set(range(3)) - {picked}:  # another pick would give other logprobs
                assert (ours - reference(llm.engine, plugin, p, {other}, tokens)).abs().max() > 1e-3
        picks.append(order[picked])
    if policy == "none":  # (this random plug-in draws the probe to one document in any order)
        assert len(set(picks)) > 1, picks  # the pick follows the question's attention, not a position
    assert_engine_idle(llm)


def windows_around_the_peaks(per_key: torch.Tensor, spans: list, blocks: int) -> list[int]:
    """The span tokens of the `blocks` blocks the budget takes (pic/focus.py): peak blocks by the
    weight their keys get, each followed by the block after it and the one before, in its span."""
    owner = {b: s for s, (start, end) in enumerate(spans) for b in range(start // 16, end // 16)}
    score = {b: float(per_key[b * 16:(b + 1) * 16].sum()) for b in owner}
    peaks, taken = sorted(score, key=score.get, reverse=True), []
    for i, peak in enumerate(peaks):
        if len(taken) == blocks:
            break
        assert score[peak] - score[peaks[i + 1]] > 1e-3 * score[peak]  # a clear order: no tie to break
        around = [b for b in (peak, peak + 1, peak - 1) if owner.get(b) == owner[peak] and b not in taken]
        taken += around[:blocks - len(taken)]
    return [t for b in sorted(taken) for t in range(b * 16, (b + 1) * 16)]


@pytest.mark.parametrize("budget", [48, 20])
def test_focus_tokens_recompute_the_blocks_around_the_questions_peak(tiny_llama4_path, peaked_plugin, budget):
    """focus_tokens: the blocks around the key block the question reads most, up to the budget
    in whole blocks (20 tokens: two), are recomputed in context; the reference links exactly
    those tokens in a dense forward."""
    llm = make_llm(tiny_llama4_path, comb_plugin=str(peaked_plugin))
    plugin = llm.engine.comb
    runner = llm.engine.runner
    chosen, select, probed, probe = [], runner.focus_select, [], runner.focus_weights
    runner.focus_select = lambda req, link: chosen.append(select(req, link)) or chosen[-1]
    runner.focus_weights = lambda req: probed.append(probe(req)) or probed[-1]
    for order in ([2, 0, 1], [0, 2, 1]):
        p = prompt(order, LONG_DOCS)
        with torch.no_grad():
            expected = voting(key_attention(llm.engine, plugin, p))
            linked = windows_around_the_peaks(expected.sum((0, 1)), p["spans"], -(-budget // 16))
            out, tokens = run(llm, p, link_policy="comb", focus_tokens=budget)
            torch.testing.assert_close(probed.pop(), expected, atol=1e-4, rtol=1e-4)
            assert chosen.pop() == linked
            ours = logprobs(out, tokens)
            torch.testing.assert_close(ours, reference(llm.engine, plugin, p, set(), tokens, tuple(linked)),
                                       atol=1e-4, rtol=0)
            shifted = tuple(t + 16 if t + 16 < p["spans"][-1][1] else t - 48 for t in linked)
            assert (ours - reference(llm.engine, plugin, p, set(), tokens, shifted)).abs().max() > 1e-3
    assert_engine_idle(llm)


def test_focus_leaves_the_shared_span_blocks_as_cached(tiny_llama_path, plugin_file):
    """The probe's scratch KV and the recomputed span go to the request's own blocks: a request
    without focus reads the same span blocks afterwards as a fresh engine computes them."""
    llm = make_llm(tiny_llama_path, comb_plugin=str(plugin_file), link_policy="comb")
    p = prompt([0, 1, 2])
    run(llm, p, focus_spans=2)
    after, tokens = run(llm, {**p, "prompt_token_ids": p["prompt_token_ids"][:-1] + [7]})
    full_blocks = sum(len(d) for d in DOCS)
    assert after.num_cached_tokens >= full_blocks
    fresh, fresh_tokens = run(make_llm(tiny_llama_path, comb_plugin=str(plugin_file), link_policy="comb"),
                              {**p, "prompt_token_ids": p["prompt_token_ids"][:-1] + [7]})
    assert tokens == fresh_tokens
    torch.testing.assert_close(logprobs(after, tokens), logprobs(fresh, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("focus", [{"focus_tokens": 48}, {"focus_spans": 2}])
def test_a_focus_probe_reads_the_shared_span_blocks_and_copies_only_what_it_links(tiny_llama_path, plugin_file,
                                                                                 focus):
    """Before its probe a focus request holds no copy of its spans (a copy of every span block
    per request evicted the other cached documents of a batch); it holds spares for the blocks
    its budget can link, and the relink turns exactly the linked blocks into private copies."""
    llm = make_llm(tiny_llama_path, comb_plugin=str(plugin_file), link_policy="comb")
    engine, p = llm.engine, prompt([0, 2, 1], LONG_DOCS)
    run(llm, p)  # the spans are cached
    pool, free = engine.kv.pool, engine.kv.pool.num_free
    engine.add_request(p, greedy(2, **focus))
    relinked, relink = [], engine.kv.relink
    engine.kv.relink = lambda req, linked: relinked.append((req, linked, relink(req, linked))) or relinked[-1][2]
    engine.step()  # admitted: its spans are hits, the question is computed; the probe is next step
    (req,) = engine.scheduler.running
    span_blocks = [i for start, end in p["spans"] for i in range(start // 16, end // 16)]
    assert req.shadows == {} and not relinked
    assert all(req.block_table[i] is pool.lookup(req.local_hashes[i]) for i in span_blocks)
    spares = 3 if "focus_tokens" in focus else 8  # 48 tokens: 3 blocks; the two longest spans: 2 x 4 blocks
    assert len(req.spare_blocks) == spares
    assert free - pool.num_free == len(req.block_table) + spares  # its view (hits revived, the question) and spares
    engine.step()
    (_, linked, copies), = relinked
    linked_blocks = sorted({t // 16 for t in linked})
    assert sorted(req.shadows) == linked_blocks and len(copies) == len(linked_blocks) > 0
    assert all(req.shadows[i] is pool.lookup(req.local_hashes[i]) for i in linked_blocks)
    assert req.spare_blocks == [] and all(req.block_table[i].ref_cnt == 1 for i in linked_blocks)
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_free == free
    assert_engine_idle(llm)


def test_focus_on_every_span_is_the_full_context(tiny_llama_path):
    llm = make_llm(tiny_llama_path)
    p = prompt([1, 2, 0])
    out, tokens = run(llm, p, link_policy="none", focus_spans=3)
    plain, plain_tokens = run(llm, {"prompt_token_ids": p["prompt_token_ids"]})
    assert tokens == plain_tokens
    torch.testing.assert_close(logprobs(out, tokens), logprobs(plain, tokens), atol=1e-4, rtol=0)


def test_an_engine_default_focus_applies_to_none_and_comb_only(tiny_llama_path):
    llm = make_llm(tiny_llama_path, focus_spans=1)
    assert llm.engine.link_policy(SamplingParams()).focus_spans == 1
    assert llm.engine.link_policy(SamplingParams(link_policy="gap")).focus_spans == 0
    assert llm.engine.link_policy(SamplingParams(focus_spans=0)).focus_spans == 0
    assert llm.generate(prompt([0, 1]), greedy(2, link_policy="gap"))[0].outputs[0].token_ids
    by_tokens = make_llm(tiny_llama_path, focus_tokens=48).engine
    assert by_tokens.link_policy(SamplingParams()).focus_tokens == 48
    # a request's own focus sizes the pick: its focus_spans replaces the engine's focus_tokens
    mine = by_tokens.link_policy(SamplingParams(focus_spans=1))
    assert (mine.focus_spans, mine.focus_tokens) == (1, 0)


@pytest.mark.parametrize("fields", [{"focus_spans": -1}, {"focus_spans": True}, {"focus_spans": 1.5},
                                    {"link_policy": "gap", "focus_spans": 1},
                                    {"link_policy": "blend", "focus_spans": 2},
                                    {"focus_tokens": -16}, {"focus_tokens": "64"},
                                    {"link_policy": "ape", "focus_tokens": 48},
                                    {"focus_spans": 1, "focus_tokens": 48}])
def test_bad_focus_settings_are_invalid_requests(fields):
    with pytest.raises(InvalidRequestError, match="focus_"):
        SamplingParams(**fields)


def test_focus_blocks_take_windows_around_the_peaks_inside_their_spans():
    # blocks: 0 outside every span, 1-3 span 0, 4-5 span 1, 6 outside
    spans = np.array([-1, 0, 0, 0, 1, 1, -1])
    scores = np.array([9.0, 1.0, 2.0, 0.5, 5.0, 3.0, 8.0])
    assert focus_blocks(scores, spans, 3) == [4, 5, 2]  # peak 4: next 5, previous 3 is another span's
    assert focus_blocks(scores, spans, 2) == [4, 5]
    assert focus_blocks(scores, spans, 5) == [4, 5, 2, 3, 1]  # then peak 2 (5 is taken): 3 after it, 1 before
    assert focus_blocks(scores, spans, 9) == [4, 5, 2, 3, 1]  # every span block, never one outside
    assert focus_blocks(np.zeros(7), spans, 3) == []  # keys nobody reads: nothing to recompute


def test_a_plugins_probe_heads_vote_for_the_requests_it_encodes(tiny_llama4_path, peaked_plugin, tmp_path):
    """Probe heads shipped in a plug-in (`spanserve train probe`): the probe of a request under
    comb sums exactly those heads, stopping after the last one's layer; under none it keeps the
    default voters (the heads were chosen on the plug-in's KV)."""
    plugin = CombPlugin.load(peaked_plugin)
    plugin.probe_heads = [[2, 1], [0, 3], [2, 0]]
    path = tmp_path / "heads.safetensors"
    plugin.save(path)
    llm = make_llm(tiny_llama4_path, comb_plugin=str(path))
    runner = llm.engine.runner
    probed, probe = [], runner.focus_weights
    runner.focus_weights = lambda req: probed.append(probe(req)) or probed[-1]
    p = prompt([2, 0, 1])
    for policy, encoder, pairs in (("comb", llm.engine.comb, [(0, 3), (2, 0), (2, 1)]), ("none", None, None)):
        with torch.no_grad():
            expected = voting(key_attention(llm.engine, encoder, p), pairs)
        run(llm, p, link_policy=policy, focus_spans=1)
        torch.testing.assert_close(probed.pop(), expected, atol=1e-4, rtol=1e-4)
    assert_engine_idle(llm)


def test_probe_heads_that_do_not_fit_the_model_are_refused_at_start(tiny_llama4_path, peaked_plugin, tmp_path):
    plugin = CombPlugin.load(peaked_plugin)
    plugin.probe_heads = [[1, 0], [7, 0]]  # the model has four layers
    path = tmp_path / "bad-heads.safetensors"
    plugin.save(path)
    with pytest.raises(InvalidRequestError, match=r"probe heads \[\(7, 0\)\] do not exist"):
        make_llm(tiny_llama4_path, comb_plugin=str(path))
