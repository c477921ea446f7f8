"""The sampler on hand-made logits: each rule changes exactly the tokens it should."""

import math

import pytest
import torch

from spanserve import SamplingParams
from spanserve.engine import sampler as sampler_module
from spanserve.engine.request import Request
from spanserve.engine.sampler import sample

EOS = 3


def request(prompt=(2,), output=(), **params) -> Request:
    req = Request("r", prompt_token_ids=list(prompt), params=SamplingParams(**params), eos_token_ids=[EOS])
    for token in output:
        req.append_token(token)
    return req


def pick(logits: list[float], req: Request) -> int:
    return sample(torch.tensor([logits]), [req])[0].token_id


def draws(logits: list[float], count: int, **params) -> torch.Tensor:
    """`count` sampled tokens from one seeded request (same logits every time)."""
    req = request(**{"temperature": 1.0, "seed": 0, **params})
    return torch.tensor([pick(logits, req) for _ in range(count)])


# ---- penalties ------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty, expected", [(1.4, 0), (2.0, 1)])
def test_repetition_penalty_divides_a_positive_logit_of_a_prompt_token(penalty, expected):
    # 3.0 / 1.4 = 2.14 still beats 2.0; 3.0 / 2.0 = 1.5 does not.
    assert pick([3.0, 2.0, -9, -9], request(prompt=[0], temperature=0, repetition_penalty=penalty)) == expected


@pytest.mark.parametrize("penalty, expected", [(1.4, 0), (2.0, 1)])
def test_repetition_penalty_multiplies_a_negative_logit_of_an_output_token(penalty, expected):
    # -1.0 * 1.4 = -1.4 still beats -1.5; -1.0 * 2.0 = -2.0 does not.
    req = request(output=[0], temperature=0, repetition_penalty=penalty)
    assert pick([-1.0, -1.5, -9, -9], req) == expected


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    req = request(prompt=[0, 0, 0], temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    assert pick([3.0, 2.0, -9, -9], req) == 0


@pytest.mark.parametrize("output, expected", [([0], 0), ([0, 0], 1)])
def test_frequency_penalty_grows_with_the_count(output, expected):
    # 3.0 - 0.6 * count: 2.4 beats 2.0, 1.8 does not.
    assert pick([3.0, 2.0, -9, -9], request(output=output, temperature=0, frequency_penalty=0.6)) == expected


@pytest.mark.parametrize("penalty, expected", [(0.9, 0), (1.1, 1)])
def test_presence_penalty_is_subtracted_once_whatever_the_count(penalty, expected):
    req = request(output=[0, 0, 0], temperature=0, presence_penalty=penalty)
    assert pick([3.0, 2.0, -9, -9], req) == expected


def test_logprobs_are_those_of_the_raw_logits_before_penalties():
    logits = [3.0, 2.0, 0.0, 0.0]
    req = request(prompt=[0], temperature=0, repetition_penalty=2.0, logprobs=2)
    s = sample(torch.tensor([logits]), [req])[0]
    raw = torch.tensor(logits).log_softmax(-1)
    assert s.token_id == 1
    assert s.logprob == pytest.approx(raw[1].item())
    assert s.top_logprobs == pytest.approx({0: raw[0].item(), 1: raw[1].item()})


# ---- min_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_output, expected", [(1, 1), (2, EOS)])
def test_min_tokens_masks_eos_until_reached(num_output, expected):
    req = request(output=[0] * num_output, temperature=0, min_tokens=2)
    assert pick([0.0, 1.0, 0.0, 5.0], req) == expected


def test_min_tokens_masks_stop_token_ids_too():
    req = request(temperature=0, min_tokens=1, stop_token_ids=[2])
    assert pick([0.0, 1.0, 5.0, 0.0], req) == 1


# ---- filters and the sampling distribution ---------------------------------------------------


def test_sampling_follows_the_softmax_distribution():
    tokens = draws([math.log(0.75), math.log(0.25)], 4000)
    assert (tokens == 0).float().mean().item() == pytest.approx(0.75, abs=0.03)


def test_temperature_flattens_the_distribution():
    # p = [0.75, 0.25] at temperature 1 becomes [0.634, 0.366] at temperature 2.
    tokens = draws([math.log(0.75), math.log(0.25)], 4000, temperature=2.0)
    assert (tokens == 0).float().mean().item() == pytest.approx(math.sqrt(3) / (1 + math.sqrt(3)), abs=0.03)


def test_top_k_keeps_only_the_k_most_likely_tokens():
    tokens = draws([0.3, 0.2, 0.1, 0.0], 400, top_k=2)
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.parametrize("top_p, kept", [(0.45, {0}), (0.6, {0, 1}), (0.85, {0, 1, 2})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = [0.5, 0.3, 0.2]
    tokens = draws([math.log(p) for p in probs], 400, top_p=top_p)
    assert set(tokens.tolist()) == kept


@pytest.mark.parametrize("min_p, kept", [(0.5, {0, 1}), (0.7, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, kept):
    # Threshold min_p * 0.5: 0.25 keeps p=0.3, 0.35 does not.
    probs = [0.5, 0.3, 0.2]
    tokens = draws([math.log(p) for p in probs], 400, min_p=min_p)
    assert set(tokens.tolist()) == kept


def test_seeded_requests_draw_the_same_sequence():
    logits = [0.0] * 50
    first, second = request(temperature=1.0, seed=7), request(temperature=1.0, seed=7)
    assert [pick(logits, first) for _ in range(20)] == [pick(logits, second) for _ in range(20)]


def test_a_seeded_request_draws_the_same_whatever_shares_its_batch():
    seeded = [request(temperature=1.0, seed=11) for _ in range(2)]
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    alone = [sample(logits[1:2], [seeded[0]])[0].token_id for _ in range(10)]
    batched = [sample(logits, [request(temperature=1.0), seeded[1], request(temperature=0.7, seed=3)])[1].token_id
               for _ in range(10)]
    assert alone == batched


def test_a_draw_at_the_very_top_of_the_mass_is_the_last_possible_token(monkeypatch):
    """The uniform number times the row's total can round past the last cumulative sum: never to a
    token of probability zero, nor past the vocabulary."""
    probs = torch.tensor([[0.2, 0.0, 0.8, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(sampler_module.torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert sampler_module._draw_rows(probs, [None, None]).tolist() == [2, 1]


def test_a_batch_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.5]])
    greedy_req, sampled_req = request(temperature=0), request(temperature=1.0, seed=1)
    picks = [sample(logits, [greedy_req, sampled_req]) for _ in range(100)]
    assert {s[0].token_id for s in picks} == {1}
    assert {s[1].token_id for s in picks} == {0, 1, 2}


# ---- extreme values (issue 13's probe: each turned the logits into NaN and every token into 0) -------


@pytest.mark.parametrize("params", [dict(temperature=1e-38), dict(top_p=5e-324), dict(temperature=1e-38, top_p=1e-300),
                                    dict(temperature=1e-38, top_k=2)])
def test_extreme_temperature_and_top_p_sample_the_most_likely_token(params):
    logits = [0.5, -1.0, 3.0, 2.9]  # the best is token 2, not token 0
    assert draws(logits, 20, **params).tolist() == [2] * 20


@pytest.mark.parametrize("penalty", [5e-324, 0.0, 1e6])
def test_repetition_penalties_that_overflow_are_rejected(penalty):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


def test_seeds_beyond_what_a_generator_takes_are_rejected():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=10**23)


@pytest.mark.parametrize("rows", [
    [[1.0, 3.0, 3.0, 0.0]],  # equal maxima: the first
    [[math.nan, 5.0, math.nan, 1.0], [2.0, math.nan, 9.0, math.inf]],  # a NaN counts as the maximum
    [[-math.inf] * 4],
])
def test_greedy_rows_take_torchs_argmax_ties_and_nans_included(rows):
    logits = torch.tensor(rows)
    assert sampler_module.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert sampler_module.argmax_rows(logits[:, ::2]).tolist() == logits[:, ::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [{}, {"repetition_penalty": 2.0}, {"min_tokens": 4}])
def test_sampling_leaves_the_callers_logits_as_they_were(params):
    logits = torch.tensor([[0.5, 3.0, 2.9, 3.1], [1.0, 0.0, 4.0, 0.0]])
    before = logits.clone()
    tokens = [s.token_id for s in sample(logits, [request(prompt=(2, 3), temperature=0, **params)] * 2)]
    assert torch.equal(logits, before)
    assert tokens == ([1, 2] if params else [3, 2])  # 3: end of sequence, held back by min_tokens
