"""SamplingParams end to end: seeds, n, stop conditions, logprobs, penalties, filters.

Tiny random models in float32; the real SmolLM2 only where a natural EOS is needed.
"""

import pytest
from helpers import EOS_TOKEN_ID, assert_engine_idle, greedy, random_prompt

from spanserve import LLM, SamplingParams

PROMPT = random_prompt(30, seed=1)


def generate(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT):
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert_engine_idle(llm)
    return out


def sampled(seed: int | None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=128)


@pytest.fixture(scope="module")
def repetitive_llm(tiny_qwen3_path):
    """The tiny Qwen3 repeats one token over and over under greedy decoding."""
    return LLM(model=str(tiny_qwen3_path), dtype="float32", num_blocks=32)


@pytest.fixture(scope="module")
def full(llm):
    """The greedy 24-token continuation of PROMPT, unconstrained."""
    return generate(llm, greedy(24)).outputs[0]


# ---- seeds and n ---------------------------------------------------------------------------


def test_same_seed_gives_the_same_sample(llm):
    assert generate(llm, sampled(42)).outputs[0].token_ids == generate(llm, sampled(42)).outputs[0].token_ids


def test_different_seeds_give_different_samples(llm):
    assert generate(llm, sampled(1)).outputs[0].token_ids != generate(llm, sampled(2)).outputs[0].token_ids


def test_seeded_sample_does_not_depend_on_the_rest_of_the_batch(llm):
    alone = generate(llm, sampled(42)).outputs[0].token_ids
    prompts = [{"prompt_token_ids": random_prompt(12, seed=9)}, {"prompt_token_ids": PROMPT},
               {"prompt_token_ids": random_prompt(50, seed=10)}]
    batch = llm.generate(prompts, [sampled(None), sampled(42), greedy(16)])
    assert batch[1].outputs[0].token_ids == alone


def test_n2_with_a_seed_is_reproducible_and_its_children_differ(llm):
    first = generate(llm, sampled(42, n=2))
    second = generate(llm, sampled(42, n=2))
    tokens = [c.token_ids for c in first.outputs]
    assert [c.finish_reason for c in first.outputs] == ["length", "length"]
    assert tokens == [c.token_ids for c in second.outputs]
    assert tokens[0] != tokens[1]


def test_first_of_n_children_equals_the_n1_sample_with_the_same_seed(llm):
    # Child i samples with seed + i.
    children = generate(llm, sampled(42, n=2)).outputs
    assert children[0].token_ids == generate(llm, sampled(42)).outputs[0].token_ids
    assert children[1].token_ids == generate(llm, sampled(43)).outputs[0].token_ids


def test_n2_greedy_children_are_identical(llm, full):
    out = generate(llm, greedy(24, n=2))
    assert [c.token_ids for c in out.outputs] == [full.token_ids, full.token_ids]


# ---- filters that leave one token behave like greedy ----------------------------------------


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
                         ids=["top_k=1", "top_p=1e-6", "min_p=1"])
def test_a_filter_that_keeps_only_the_top_token_equals_greedy(llm, full, kwargs):
    out = generate(llm, SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, **kwargs))
    assert out.outputs[0].token_ids == full.token_ids


def test_top_k_2_picks_only_tokens_in_the_top_2(llm):
    out = generate(llm, sampled(3, top_k=2, logprobs=2))
    choices = out.outputs[0]
    assert all(len(top) == 2 and t in top for t, top in zip(choices.token_ids, choices.logprobs))


# ---- stop conditions ------------------------------------------------------------------------


def test_max_tokens_ends_with_finish_reason_length(llm):
    out = generate(llm, greedy(5)).outputs[0]
    assert (len(out.token_ids), out.finish_reason, out.stop_reason) == (5, "length", None)


def test_stop_string_truncates_text_before_it(llm, full):
    stop = full.text[10:14]
    out = generate(llm, greedy(24, stop=[stop])).outputs[0]
    assert out.text == full.text[: full.text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < 24
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_stop_string_is_kept_with_include_stop_str_in_output(llm, full):
    stop = full.text[10:14]
    out = generate(llm, greedy(24, stop=stop, include_stop_str_in_output=True)).outputs[0]
    assert out.text == full.text[: full.text.find(stop) + len(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_token_id_ends_generation_with_that_token_as_stop_reason(llm, full):
    stop_token = full.token_ids[5]
    assert stop_token not in full.token_ids[:5]
    out = generate(llm, greedy(24, stop_token_ids=[stop_token])).outputs[0]
    assert out.token_ids == full.token_ids[:6]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.text == generate(llm, greedy(5)).outputs[0].text  # the stop token's text is left out


def test_min_tokens_suppresses_a_stop_token_until_reached(llm, full):
    stop_token = full.token_ids[2]
    out = generate(llm, greedy(24, stop_token_ids=[stop_token], min_tokens=10)).outputs[0]
    assert len(out.token_ids) >= 10
    assert stop_token not in out.token_ids[:10]
    assert out.token_ids[:2] == full.token_ids[:2]


def test_min_tokens_holds_back_a_stop_string(llm, full):
    stop = full.text[:4]
    assert generate(llm, greedy(24, stop=stop)).outputs[0].text == ""
    out = generate(llm, greedy(24, stop=stop, min_tokens=10)).outputs[0]
    assert len(out.token_ids) >= 10
    assert out.token_ids[:10] == full.token_ids[:10]


@pytest.mark.slow
def test_eos_ends_a_reply_with_finish_reason_stop(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is 2+2? Answer with just the number."}],
                           SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert out.token_ids[-1] == EOS_TOKEN_ID and len(out.token_ids) < 32
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert "<|im_end|>" not in out.text


@pytest.mark.slow
def test_min_tokens_and_ignore_eos_generate_past_eos(smollm2_llm):
    messages = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]
    reply = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].token_ids
    past = len(reply) + 4
    held = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=32, min_tokens=past))[0].outputs[0]
    assert len(held.token_ids) >= past
    assert EOS_TOKEN_ID not in held.token_ids[:past]
    ignored = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=past, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids[: len(reply)] == reply  # EOS included, then generation goes on
    assert (len(ignored.token_ids), ignored.finish_reason) == (past, "length")
    assert_engine_idle(smollm2_llm)


# ---- logprobs -------------------------------------------------------------------------------


def test_greedy_logprobs_hold_the_top_n_with_the_chosen_token_first(llm):
    out = generate(llm, greedy(6, logprobs=3)).outputs[0]
    assert len(out.logprobs) == 6
    for token, top in zip(out.token_ids, out.logprobs):
        assert len(top) == 3
        assert max(top, key=top.get) == token
        assert all(lp <= 0 for lp in top.values())


def test_sampled_logprobs_always_contain_the_chosen_token(llm):
    out = generate(llm, sampled(11, logprobs=2)).outputs[0]
    assert all(token in top and len(top) in (2, 3) for token, top in zip(out.token_ids, out.logprobs))
    assert any(len(top) == 3 for top in out.logprobs)  # a sample outside the top 2 is added to it


def test_logprobs_zero_returns_only_the_chosen_token(llm):
    out = generate(llm, greedy(4, logprobs=0)).outputs[0]
    assert [list(top) for top in out.logprobs] == [[t] for t in out.token_ids]


def test_cumulative_logprob_is_the_sum_of_chosen_logprobs(llm):
    out = generate(llm, sampled(4, logprobs=1)).outputs[0]
    expected = sum(top[t] for t, top in zip(out.token_ids, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(expected)


def test_no_logprobs_unless_asked(llm):
    out = generate(llm, greedy(4)).outputs[0]
    assert (out.logprobs, out.cumulative_logprob) == (None, None)


# ---- penalties ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repetitive(repetitive_llm):
    out = generate(repetitive_llm, greedy(24), prompt=random_prompt(8, seed=2)).outputs[0]
    assert len(set(out.token_ids)) <= 4  # the unpenalized output repeats
    return out


@pytest.mark.parametrize("kwargs", [{"repetition_penalty": 1.5}, {"presence_penalty": 1.0},
                                    {"frequency_penalty": 1.0}], ids=lambda kw: next(iter(kw)))
def test_penalties_reduce_repetition_of_greedy_output(repetitive_llm, repetitive, kwargs):
    out = generate(repetitive_llm, greedy(24, **kwargs), prompt=random_prompt(8, seed=2)).outputs[0]
    assert out.token_ids != repetitive.token_ids
    assert len(set(out.token_ids)) > len(set(repetitive.token_ids))


def test_negative_presence_penalty_rewards_repetition(repetitive_llm):
    prompt = random_prompt(8, seed=3)
    plain = generate(repetitive_llm, greedy(24), prompt=prompt).outputs[0].token_ids
    rewarded = generate(repetitive_llm, greedy(24, presence_penalty=-2.0), prompt=prompt).outputs[0].token_ids
    assert len(set(rewarded)) == 1
    assert rewarded[0] == plain[0]
