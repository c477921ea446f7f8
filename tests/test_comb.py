"""link_policy="comb": span KV written by a trained encoder plug-in (spanserve/comb/).

The engine's paged, batched, cached path must compute what the dense reference
(spanserve/comb/dense.py, the training forward) computes, at any span position, cold or warm.
"""

import httpx
import pytest
import torch
from helpers import assert_engine_idle, greedy, random_prompt
from safetensors.torch import save_file
from server_utils import ServerProcess, assert_openai_error

from spanserve import LLM, InvalidRequestError, SamplingParams
from spanserve.comb import dense
from spanserve.comb.plugin import CombPlugin
from spanserve.pic.link import AUTO_FOCUS_TOKENS
from spanserve.spans.api import prepare, query_tokenizer
from spanserve.spans.executor import inner_calls
from spanserve.spans.ir import cross, g, plus, system, user

DOCS = [random_prompt(32, seed=60), random_prompt(48, seed=61), random_prompt(20, seed=62)]
HEAD, QUESTION = random_prompt(16, seed=63), random_prompt(7, seed=64)


def make_llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=256, **kwargs)


def random_plugin(llm: LLM, seed: int = 0, reader: bool = True) -> CombPlugin:
    """Deltas large enough to change the outputs (a trained plug-in's B is not zero)."""
    plugin = CombPlugin.zeros(llm.engine.runner.model, rank=4, seed=seed, reader=reader)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, (a, b) in plugin.deltas.items():
        plugin.deltas[name] = (a, 0.05 * torch.randn(b.shape, generator=gen))
    return plugin


@pytest.fixture(scope="module")
def plugin_files(tiny_llama_path, tmp_path_factory):
    """With reader deltas (the tokens after the spans read through them) and without."""
    folder, llm = tmp_path_factory.mktemp("comb"), make_llm(tiny_llama_path)
    for reader in (True, False):
        random_plugin(llm, reader=reader).save(folder / f"reader-{reader}.safetensors")
    return {reader: folder / f"reader-{reader}.safetensors" for reader in (True, False)}


@pytest.fixture
def plugin_file(plugin_files):
    return plugin_files[True]


@pytest.fixture
def comb_llm(tiny_llama_path, plugin_file):
    return make_llm(tiny_llama_path, comb_plugin=str(plugin_file), link_policy="comb")


def prompt(order: list[int]) -> dict:
    """HEAD, then the documents in `order` (each padded to whole blocks), then QUESTION."""
    ids, spans = list(HEAD), []
    for i in order:
        doc = DOCS[i] + [0] * (-len(DOCS[i]) % 16)
        spans.append([len(ids), len(ids) + len(doc)])
        ids += doc
    return {"prompt_token_ids": ids + QUESTION, "spans": spans}


def reference_logprobs(llm: LLM, p: dict, generated: list[int]) -> torch.Tensor:
    """Dense COMB logprobs after the prompt and each generated token but the last."""
    engine = llm.engine
    ids = p["prompt_token_ids"] + generated
    layout = dense.DenseLayout.for_engine(engine, ids, p["spans"])
    first = len(p["prompt_token_ids"]) - 1
    with torch.no_grad():
        logits = dense.forward(engine.runner.model, engine.comb, layout, list(range(first, len(ids) - 1)))
    return logits.log_softmax(-1).cpu()


def run(llm: LLM, p: dict, **params):
    out = llm.generate(p, greedy(6, logprobs=1, **params))[0]
    return out, list(out.outputs[0].token_ids)


@pytest.mark.parametrize("reader", [True, False], ids=["reader", "encoder-only"])
@pytest.mark.parametrize("orders", [[[0, 1, 2]], [[0, 1, 2], [2, 0, 1]]], ids=["cold", "warm-shuffled"])
def test_engine_comb_equals_the_dense_reference_cold_and_reused_at_new_positions(tiny_llama_path, plugin_files,
                                                                                  orders, reader):
    comb_llm = make_llm(tiny_llama_path, comb_plugin=str(plugin_files[reader]), link_policy="comb")
    assert comb_llm.engine.comb.has_reader == reader
    for order in orders:
        p = prompt(order)
        out, tokens = run(comb_llm, p)
        ref = reference_logprobs(comb_llm, p, tokens)
        assert tokens == ref.argmax(-1).tolist()
        ours = torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(ours, ref[torch.arange(len(tokens)), tokens], atol=1e-4, rtol=0)
    if len(orders) > 1:  # the second order reused every full span block of the first
        full_blocks = sum(len(DOCS[i]) // 16 * 16 for i in range(3))
        assert out.num_cached_tokens >= full_blocks
    assert_engine_idle(comb_llm)


def test_reader_deltas_leave_the_text_before_the_spans_to_the_plain_decoder(comb_llm, tiny_llama_path):
    """The prompt's head is shared with requests without spans: a comb request must cache the
    plain decoder's KV for it, which a plain request then reads as its own."""
    assert comb_llm.engine.comb.has_reader
    run(comb_llm, prompt([0, 1, 2]))
    plain = {"prompt_token_ids": HEAD + QUESTION}
    out, tokens = run(comb_llm, plain, link_policy="none")
    assert out.num_cached_tokens == 16  # HEAD's block, written by the comb request
    fresh, fresh_tokens = run(make_llm(tiny_llama_path), plain)
    assert tokens == fresh_tokens
    torch.testing.assert_close(torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)]),
                               torch.tensor([lp[t] for lp, t in zip(fresh.outputs[0].logprobs, tokens)]),
                               atol=1e-5, rtol=0)


def test_the_plugin_changes_the_answer_and_a_zero_plugin_equals_none(tiny_llama_path, tmp_path):
    plain = make_llm(tiny_llama_path)
    zero = CombPlugin.zeros(plain.engine.runner.model, rank=4)
    zero.save(tmp_path / "zero.safetensors")
    p = prompt([1, 0, 2])
    _, none_tokens = run(plain, p, link_policy="none")
    zero_llm = make_llm(tiny_llama_path, comb_plugin=str(tmp_path / "zero.safetensors"))
    assert run(zero_llm, p, link_policy="comb")[1] == none_tokens
    random_plugin(plain, seed=5, reader=False).save(tmp_path / "random.safetensors")
    comb = make_llm(tiny_llama_path, comb_plugin=str(tmp_path / "random.safetensors"))
    comb_out = comb.generate(p, greedy(1, logprobs=5, link_policy="comb"))[0].outputs[0].logprobs[0]
    none_out = plain.generate(p, greedy(1, logprobs=5, link_policy="none"))[0].outputs[0].logprobs[0]
    assert max(abs(comb_out[t] - none_out[t]) for t in set(comb_out) & set(none_out)) > 1e-3


def test_the_plugin_hooks_the_projections_only_while_active(comb_llm):
    """Steps without span rows (decode, plain prompts) call the projections without hooks (a hooked
    module takes PyTorch's slow call path); inside `active`, nested or not, each has one."""
    plugin, model = comb_llm.engine.comb, comb_llm.engine.runner.model
    projections = [linear for linear, _ in plugin._hooks]

    def hooked() -> list[int]:  # the plug-in's hooks on each projection (threads.py may add its own)
        return [sum(any(h is hook for _, hook in plugin._hooks) for h in p._forward_hooks.values())
                for p in projections]

    assert len(projections) == 4 * len(model.layers) and not any(hooked())
    with plugin.active(torch.tensor([0])):
        with plugin.active(None, torch.tensor([1])):
            assert hooked() == [1] * len(projections)
        assert hooked() == [1] * len(projections) and plugin.rows.tolist() == [0]
    assert not any(hooked()) and plugin.rows is None
    comb_llm.generate(prompt([2, 0, 1]), greedy(2, link_policy="comb"))
    assert not any(hooked())


@pytest.mark.parametrize("rows", [[3, 4, 5, 6, 7, 8, 9], list(range(64)), [0, 2, 3], [5]])
def test_span_rows_in_one_run_take_one_multiply_add_with_the_same_sums(comb_llm, rows):
    """A cold prompt's span rows are one run: their deltas go into the projection's output rows in
    one multiply-add, whose sums are those of delta() and index_add_ to the bit; other rows (or
    one row) take index_add_. A B changed in place is read as changed."""
    plugin, model = comb_llm.engine.comb, comb_llm.engine.runner.model
    name = "layers.1.mlp.gate_up_proj"
    linear = model.layers[1].mlp.gate_up_proj
    x, index = torch.randn(64, linear.in_features), torch.tensor(rows)
    for _ in range(2):
        with torch.no_grad():
            expected = linear(x).index_add_(0, index, plugin.delta(name, x.index_select(0, index)))
            with plugin.active(index):
                assert plugin._run == ((rows[0], rows[-1] + 1) if rows in ([3, 4, 5, 6, 7, 8, 9], list(range(64)))
                                       else None)
                assert torch.equal(linear(x), expected)
            plugin.deltas[name][1].mul_(2.0)


def test_comb_span_kv_is_never_shared_with_none_or_another_plugin(comb_llm):
    p = prompt([0, 1, 2])
    run(comb_llm, p, link_policy="none")
    cold, _ = run(comb_llm, p)  # comb after none: span blocks must be computed again
    assert cold.num_cached_tokens <= len(HEAD)
    warm, _ = run(comb_llm, p)
    assert warm.num_cached_tokens > cold.num_cached_tokens


def test_the_server_serves_comb_as_offline_and_answers_400_without_a_plugin(tiny_llama_path, plugin_file, tmp_path):
    p = prompt([2, 0])
    body = {"model": "m", "prompt": p["prompt_token_ids"], "spans": p["spans"], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "link_policy": "comb"}
    with_plugin = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "256",
                                 "--served-model-name", "m", "--comb-plugin", str(plugin_file)], tmp_path / "a.log")
    try:
        text = httpx.post(f"{with_plugin.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        with_plugin.stop()
    offline = make_llm(tiny_llama_path, comb_plugin=str(plugin_file))
    assert text == offline.generate(p, greedy(6, link_policy="comb"))[0].outputs[0].text
    without = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "256",
                             "--served-model-name", "m"], tmp_path / "b.log")
    try:
        error = assert_openai_error(httpx.post(f"{without.url}/v1/completions", json=body, timeout=60), 400, "plug-in")
        assert error["code"] == "plugin_not_loaded"
    finally:
        without.stop()


def test_comb_without_a_plugin_is_a_clear_error(tiny_llama_path):
    llm = make_llm(tiny_llama_path)
    with pytest.raises(InvalidRequestError, match="comb.*plug-in"):
        llm.generate(prompt([0]), greedy(2, link_policy="comb"))
    with pytest.raises(InvalidRequestError, match="comb.*plug-in"):
        make_llm(tiny_llama_path, link_policy="comb")


def test_a_plugin_trained_for_another_model_or_a_corrupt_file_is_rejected(tiny_qwen2_path, plugin_file, tmp_path):
    with pytest.raises(InvalidRequestError, match="another model"):
        make_llm(tiny_qwen2_path, comb_plugin=str(plugin_file))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a plug-in")
    with pytest.raises(InvalidRequestError, match="cannot read COMB plug-in"):
        make_llm(tiny_qwen2_path, comb_plugin=str(bad))
    weights = tmp_path / "weights.safetensors"  # a valid safetensors file, but not a plug-in
    save_file({"w": torch.zeros(2)}, str(weights))
    with pytest.raises(InvalidRequestError, match="not a spanserve COMB plug-in"):
        make_llm(tiny_qwen2_path, comb_plugin=str(weights))
    with pytest.raises(InvalidRequestError, match="cannot read COMB plug-in"):
        make_llm(tiny_qwen2_path, comb_plugin=str(tmp_path / "missing.safetensors"))


def test_the_default_link_policy_is_comb_where_a_plugin_is_loaded_else_none_both_with_focus(tiny_llama_path,
                                                                                           plugin_file):
    plain = make_llm(tiny_llama_path).engine
    assert (plain.default_link, plain.link_policy(SamplingParams()).focus_tokens) == ("none", AUTO_FOCUS_TOKENS)
    assert plain.link_policy(SamplingParams(link_policy="none")).focus_tokens == 0
    assert make_llm(tiny_llama_path, link_policy="none").engine.link_policy(SamplingParams()).focus_tokens == 0
    llm = make_llm(tiny_llama_path, comb_plugin=str(plugin_file))
    engine = llm.engine
    assert engine.default_link == "comb"
    assert "signature" in vars(engine.comb)  # hashed as the engine is built, on the thread that steps it
    assert engine.link_policy(SamplingParams()).focus_tokens == AUTO_FOCUS_TOKENS
    assert engine.link_policy(SamplingParams(link_policy="comb")).focus_tokens == 0  # a policy named is as named
    assert engine.link_policy(SamplingParams(focus_spans=1)).focus_tokens == 0
    p = prompt([1, 2])
    assert run(llm, p)[1] == run(llm, p, link_policy="comb", focus_tokens=AUTO_FOCUS_TOKENS)[1]
    assert make_llm(tiny_llama_path, comb_plugin=str(plugin_file), link_policy="gap").engine.default_link == "gap"
    operator = make_llm(tiny_llama_path, comb_plugin=str(plugin_file), focus_spans=1).engine  # set sizes win
    assert (operator.link_policy(SamplingParams()).focus_spans, operator.link_policy(SamplingParams()).focus_tokens) \
        == (1, 0)


def test_a_judge_reads_generated_candidates_from_the_cache_under_comb(comb_llm):
    """Candidates are generated by the decoder, but a comb span's KV is the encoder's: the span
    query encodes each candidate as it finishes, so the judge still reuses every block of them."""
    generators = [g(user(f"Write idea number {i}."), max_tokens=20, temperature=0.5, seed=i) for i in range(3)]
    query = g(cross(system("You judge ideas."), plus(*generators), user("Which idea is best?")), max_tokens=4)
    result = comb_llm.run_query(query)
    judge, tree = result.calls[-1], prepare(query).tree
    tokenizer = query_tokenizer(comb_llm.engine)
    outputs = {id(node): result.outputs[path] for path, node in inner_calls(tree.input, "$.input")}
    span_tokens = sum(end - start for start, end in tokenizer.prompt(tree, outputs)[1])
    assert span_tokens > 0 and judge.cached_tokens == len(tokenizer.static_prefix(tree)[0]) + span_tokens
    assert_engine_idle(comb_llm)

