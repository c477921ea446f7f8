"""Speculative decoding (spanserve/speculative/): prompt-lookup drafts checked by the target in one
step. Greedy output equals decoding without speculation token for token, in batches that mix
drafting and plain requests, through preemption, stop strings and sessions; sampled tokens follow
the target's distribution; no rejected token reaches the prefix cache; bad settings fail at start."""

import pytest
import torch
from helpers import assert_engine_idle, greedy, looping, random_prompt, token_ids

from spanserve import LLM, SamplingParams
from spanserve.engine.request import Request
from spanserve.engine.sampler import verify
from spanserve.models import layout
from spanserve.sparse.builtins import BUILTINS
from spanserve.sparse.decode import SparseDecode
from spanserve.speculative import ngram
from spanserve.speculative.config import SpeculativeConfig, SpeculativeConfigError
from spanserve.speculative.speculator import Speculator

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


PROMPTS = [looping(40, 1), random_prompt(23, seed=2), looping(75, 3), random_prompt(9, seed=4)]


def make_llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=128, **kwargs)


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    return make_llm(tiny_llama_path)


@pytest.fixture(scope="module")
def drafting(tiny_llama_path):
    return make_llm(tiny_llama_path, speculative_config=NGRAM)


def test_prompt_lookup_drafts_what_followed_the_last_occurrence():
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]  # the most recent match
    assert ngram.propose([5, 6, 5, 6, 5], 2, 2, 2) == [6, 5]
    assert ngram.propose([1, 2, 3, 4], 4, 1, 3) == []  # no suffix occurs earlier
    assert ngram.propose([4, 8, 4], 5, 1, 2) == [8, 4]  # only what exists after the match
    assert ngram.propose([1, 2, 3, 1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1]  # the longest suffix first


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "unknown speculative method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"\[1, 16\]"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "min <= max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 3}, "unknown field draft_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "takes the draft's model"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes the draft's model"),
    ("{not json", "not valid JSON"),
])
def test_bad_settings_fail_at_start(tiny_llama_path, config, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.of(config)
    with pytest.raises(SpeculativeConfigError, match=message):
        make_llm(tiny_llama_path, speculative_config=config)


def test_greedy_output_equals_decoding_without_speculation(plain, drafting):
    params = [greedy(40), SamplingParams(temperature=0, max_tokens=24, min_tokens=20, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2),
              greedy(33, logprobs=2)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected, got = plain.generate(prompts, params), drafting.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    speculator = drafting.engine.speculator
    assert speculator.num_accepted > 3 and speculator.num_drafted > speculator.num_accepted  # both kinds ran
    for e, g in zip(expected[3].outputs[0].logprobs, got[3].outputs[0].logprobs):  # accepted tokens' logprobs
        assert e.keys() == g.keys() and all(abs(e[t] - g[t]) < 1e-3 for t in e)
    assert_engine_idle(drafting)


def test_a_draft_never_runs_past_max_tokens_or_a_stop(plain, drafting):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    for n in (1, 2, 3, 7):
        assert len(drafting.generate(prompt, greedy(n))[0].outputs[0].token_ids) == n
    free = plain.generate(prompt, greedy(30))[0].outputs[0]
    stop = free.token_ids[12]
    expected = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))[0]
    got = drafting.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids and got.outputs[0].finish_reason == "stop"


def test_no_rejected_token_reaches_the_prefix_cache(plain, drafting):
    """A prompt made of a finished request's prompt and output finds in the cache only what the
    target wrote: its continuation is the plain engine's."""
    first = drafting.generate({"prompt_token_ids": PROMPTS[2]}, greedy(48))[0]
    again = PROMPTS[2] + first.outputs[0].token_ids
    got = drafting.generate({"prompt_token_ids": again}, greedy(16))[0]
    assert got.num_cached_tokens >= 64
    assert got.outputs[0].token_ids == plain.generate({"prompt_token_ids": again}, greedy(16))[0].outputs[0].token_ids


def test_preemption_drops_the_drafts_and_keeps_the_output(tiny_llama_path, plain):
    small = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=10, speculative_config=NGRAM)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = small.generate(prompts, greedy(40))
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.speculator.num_accepted > 0
    assert token_ids(got) == token_ids(plain.generate(prompts, greedy(40)))
    assert_engine_idle(small)


def test_a_session_question_drafts_too(plain, drafting):
    answers = []
    for llm in (plain, drafting):
        session = llm.create_session(system="Repeat the log.")
        session.append("t=1 a=7\nt=2 a=7\nt=3 a=7\nt=4 a=7\n")
        session.wait()
        answers.append(session.query("Again:", greedy(24)).text)
        session.close()
    assert answers[0] == answers[1]


def _request(params: SamplingParams) -> Request:
    return Request("r", [1, 2, 3], params)


def test_sampled_tokens_follow_the_targets_distribution():
    """Speculative sampling with a one-token draft: the first token follows p0 whatever the draft,
    and the second follows p1 where the first was the draft (checked on 8,000 draws)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    req = _request(SamplingParams(temperature=1.0, seed=11))
    firsts, seconds = torch.zeros(4), torch.zeros(4)
    for _ in range(8000):
        tokens = [s.token_id for s in verify(logits, req, [1, 3])]
        firsts[tokens[0]] += 1
        if tokens[0] == 1:
            seconds[tokens[1]] += 1
    torch.testing.assert_close(firsts / firsts.sum(), logits[0].exp(), atol=0.025, rtol=0)
    torch.testing.assert_close(seconds / seconds.sum(), logits[1].exp(), atol=0.035, rtol=0)


def test_greedy_verification_keeps_the_drafts_the_target_would_write():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    req = _request(SamplingParams(temperature=0))
    assert [s.token_id for s in verify(logits, req, [1, 0])] == [1, 0, 2]  # both stand, and one more
    assert [s.token_id for s in verify(logits, req, [1, 2])] == [1, 0]  # the second falls: the target's own
    assert [s.token_id for s in verify(logits, req, [2, 0])] == [1]


def test_a_seeded_sampled_request_is_reproducible(drafting):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=30)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    assert drafting.generate(prompt, params)[0].outputs[0].token_ids == \
        drafting.generate(prompt, params)[0].outputs[0].token_ids


def test_a_grammar_holds_the_drafts_and_the_output_is_unchanged(tiny_llama_path, plain, drafting):
    """Drafts end where the grammar would refuse; each checked row is masked as the grammar stands
    after the drafts before it: the JSON is the plain engine's, token for token."""
    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"enum": ["xy", "xyz"]}}}
    tokenizer = plain.get_tokenizer()
    quoted = tokenizer.encode('{"a": "one two three one two three", "b": "xyz"} ' * 3)
    prompts = [{"prompt_token_ids": quoted}, {"prompt_token_ids": PROMPTS[0]}]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema})
    before = drafting.engine.speculator.num_drafted
    got, expected = drafting.generate(prompts, params), plain.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert drafting.engine.speculator.num_drafted > before
    assert_engine_idle(drafting)


def test_the_server_and_the_cli_take_the_setting(tiny_llama_path, tmp_path, plain, capsys):
    import json

    import httpx
    from server_utils import ServerProcess

    from spanserve.cli import main

    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "128",
                            "--speculative-config", json.dumps(NGRAM)], tmp_path / "server.log")
    try:
        got = httpx.post(f"{server.url}/v1/completions", timeout=60,
                         json={"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}).json()
    finally:
        server.stop()
    expected = plain.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=30))[0]
    assert got["choices"][0]["text"] == expected.outputs[0].text
    with pytest.raises(SystemExit, match="num_speculative_tokens"):
        main(["generate", "hi", "--model", str(tiny_llama_path), "--speculative-config", '{"method": "ngram"}'])


def test_a_draft_model_drafts_and_the_output_is_unchanged(tiny_llama_path, plain):
    """The target itself as its own draft: every greedy draft stands."""
    llm = make_llm(tiny_llama_path, speculative_config={"method": "draft_model", "model": str(tiny_llama_path),
                                                         "num_speculative_tokens": 3})
    speculator = llm.engine.speculator
    assert speculator.draft_model.relative_cost == pytest.approx(1.0)  # its own draft: never worth a step of it
    speculator.draft_cost = 0.0  # so the mechanics are what this test checks
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [greedy(20), SamplingParams(temperature=0, max_tokens=17, repetition_penalty=1.2), greedy(9), greedy(12)]
    assert token_ids(llm.generate(prompts, params)) == token_ids(plain.generate(prompts, params))
    assert speculator.num_drafted > 20 and speculator.num_accepted >= speculator.num_drafted * 0.6
    assert_engine_idle(llm)


def test_a_draft_model_must_share_the_tokenizer_and_fit(tiny_llama_path, tiny_tools_model_path, monkeypatch):
    other = {"method": "draft_model", "model": str(tiny_tools_model_path), "num_speculative_tokens": 3}
    with pytest.raises(SpeculativeConfigError, match="another tokenizer"):
        make_llm(tiny_llama_path, speculative_config=other)
    monkeypatch.setattr("spanserve.speculative.draft_model._free_bytes", lambda device: 1000)
    with pytest.raises(SpeculativeConfigError, match="GiB are free"):
        make_llm(tiny_llama_path, speculative_config={**other, "model": str(tiny_llama_path)})


def test_spans_n_and_stop_strings_keep_the_plain_output(plain, drafting):
    """Drafts looked up in span documents reused in a new order; n > 1 siblings; a stop string."""
    from spanserve import Span

    tokenizer = plain.get_tokenizer()
    docs = [tokenizer.decode(looping(48, seed)) for seed in (7, 8, 9)]
    spanned = [Span(docs[2]), Span(docs[0]), Span(docs[1]), "Again:"]
    for llm in (plain, drafting):
        llm.generate([Span(d) for d in docs] + ["First:"], greedy(2))
    got, expected = (llm.generate(spanned, greedy(30))[0] for llm in (drafting, plain))
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids and got.num_cached_tokens > 0
    siblings = SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    outs = drafting.generate(prompt, siblings)[0].outputs
    assert len(outs) == 3 and all(len(o.token_ids) == 20 for o in outs)
    stop = plain.generate(prompt, greedy(30))[0].outputs[0].text[10:14]
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    got, expected = (llm.generate(prompt, params)[0].outputs[0] for llm in (drafting, plain))
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)
    assert_engine_idle(drafting)


@pytest.mark.parametrize("flow", ["block_topk", "quest", "h2o", "streaming"])
def test_a_sparse_flow_drafts_and_keeps_its_sparse_output(plain, drafting, flow):
    """A verify step attends through the flow row by row: the tokens and logprobs of sparse decode
    without drafts, H2O's accumulated state rolled back past the rejected rows."""
    prompts = [{"prompt_token_ids": looping(470, seed)} for seed in (7, 11)]  # the tiny model loops on these
    params = greedy(32, logprobs=1, sparse=flow, sparse_budget=96)  # 6 of some 30 blocks: it narrows
    dense = plain.generate(prompts, greedy(32, logprobs=1))
    expected = plain.generate(prompts, params)
    speculator = drafting.engine.speculator
    before = speculator.num_accepted
    got = drafting.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    for e, g, d in zip(expected, got, dense):
        e, g, d = e.outputs[0].logprobs, g.outputs[0].logprobs, d.outputs[0].logprobs
        assert all(abs(x[t] - y[t]) < 1e-4 for x, y in zip(e, g) for t in x)
    assert any(abs(max(x.values()) - max(y.values())) > 1e-3 for o, s in zip(dense, expected)
               for x, y in zip(o.outputs[0].logprobs, s.outputs[0].logprobs))  # narrowed: not dense attention
    assert speculator.num_accepted - before > 10
    assert_engine_idle(drafting)


def test_a_verify_step_rolls_a_flows_state_back_to_its_last_accepted_row():
    decode = SparseDecode(BUILTINS["h2o"](), 96, 16)
    decode.state[0] = {"acc": torch.zeros(2)}
    decode.begin(3)  # a real token and two drafts
    for row in range(3):
        state, step = decode.picking(0, row)
        assert step == row + 1
        state["acc"] += 1  # changed in place: the kept state must not follow it
        decode.picked(0, row)
    decode.verified(2)  # the first draft accepted, the second rejected
    assert decode.state[0]["acc"].tolist() == [2, 2] and decode.steps == 2
    decode.begin(1)
    assert decode.picking(0, 0)[1] == 3 and decode.trail is None


def test_a_bf16_verify_step_computes_each_row_as_its_decode_step(tiny_llama_path, monkeypatch):
    """On CPU a checked row goes through the decode kernel as at its own decode step: the logprobs
    of plain decoding exactly, in bf16, where a prefill kernel's rounding differs. (The bf16
    projections take the C GEMM up to 64 rows on every CPU here, whatever its calibration says.)"""
    monkeypatch.setattr(layout.calibration, "bf16_gemm_rows", lambda *shape: 64)
    prompts = [{"prompt_token_ids": p} for p in (looping(300, 7), looping(120, 11))]
    outs = []
    for config in (None, NGRAM):
        llm = LLM(model=str(tiny_llama_path), dtype="bfloat16", num_blocks=64, speculative_config=config)
        outs.append(llm.generate(prompts, greedy(32, logprobs=3)))
    assert token_ids(outs[1]) == token_ids(outs[0])
    assert [o.outputs[0].logprobs for o in outs[1]] == [o.outputs[0].logprobs for o in outs[0]]
    assert llm.engine.speculator.num_accepted > 10


class _Decoding:
    """What the speculator reads of a decoding request."""

    def __init__(self):
        self.num_tokens, self.num_output_tokens, self.max_total_tokens = 100, 10, 4096
        self.params = SamplingParams(max_tokens=200)


def _counts(acceptances: list[float], draft_cost: float = 0.0, k: int = 5) -> list[int]:
    speculator = Speculator(SpeculativeConfig("ngram", k))
    speculator.draft_cost = draft_cost  # (as a draft model's measured step)
    requests = [_Decoding() for _ in acceptances]
    for req, acceptance in zip(requests, acceptances):
        speculator._state(req).acceptance = acceptance
    if draft_cost:
        speculator.draft_model = object()
    counts = speculator._counts(requests)
    return [counts.get(req, 0) for req in requests]


def test_a_draft_is_as_long_as_its_tokens_are_worth_their_cost():
    """The j-th draft token stands with probability a**j; it must beat its share of the step, the
    step's budget goes to the tokens worth most, and a draft model's position must pay its step."""
    assert _counts([0.7], k=16) == [7]  # batch 1: 0.7**7 = 0.082 > 0.06 > 0.7**8
    assert _counts([0.7], k=5) == [5]
    assert _counts([0.7] * 8) == [2] * 8  # batch 8: 0.49 > 0.48 > 0.34
    assert _counts([0.95] * 4 + [0.6] * 4) == [4] * 4 + [0] * 4  # the budget of 16 to the likeliest
    assert _counts([0.97] * 8, draft_cost=0.4) == [2] * 8  # 8 x 0.46 at position 2 beats 0.4 x 8
    assert _counts([0.97] * 8, draft_cost=0.5) == [0] * 8
    assert _counts([0.9], draft_cost=0.4) == [5]  # batch 1: 0.9**5 - 0.06 beats 0.4
    assert _counts([0.3] * 8) == [1] * 8  # not worth it: one token to learn, then a pause
    assert _counts([0.3] * 8, draft_cost=0.4) == [0] * 8  # not even that where the draft's step costs 0.4 x 8
    assert _counts([0.3], draft_cost=0.4) == [1]  # at batch 1 a probe pays for itself if it stands
