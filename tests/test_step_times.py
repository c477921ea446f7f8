"""The engine's step counters (engine/step_times.py): steps, tokens and time by kind of step, and
the part of each step inside the model."""

import pytest

from spanserve import LLM, SamplingParams
from spanserve.engine.step_times import StepTimes, step_kind


@pytest.mark.parametrize(("decoding", "prefilling", "kind"), [(3, 0, "decode"), (0, 2, "prefill"), (1, 1, "mixed")])
def test_a_step_is_named_by_what_its_requests_do(decoding, prefilling, kind):
    assert step_kind(decoding, prefilling) == kind


def test_totals_add_up_per_kind():
    times = StepTimes()
    times.add("decode", 8, 0.030, 0.027)
    times.add("decode", 7, 0.020, 0.018)
    decode = times.totals["decode"]
    assert (decode.steps, decode.tokens) == (2, 15)
    assert decode.seconds == pytest.approx(0.05) and decode.model_seconds == pytest.approx(0.045)
    assert times.totals["prefill"].steps == times.totals["mixed"].steps == 0


def test_an_engine_counts_its_prefill_and_decode_steps(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12, 13]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    totals = llm.engine.step_times.totals
    prefill, decode = totals["prefill"], totals["decode"]
    # both prompts in one step, which samples each one's first token; then three steps of two
    assert (prefill.steps, prefill.tokens) == (1, 8)
    assert (decode.steps, decode.tokens) == (3, 6)
    assert totals["mixed"].steps == 0
    for total in (prefill, decode):
        assert 0 < total.model_seconds < total.seconds


def test_a_draft_models_passes_are_model_time_of_the_targets_steps(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=128,
              speculative_config={"method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 2})
    llm.engine.speculator.draft_cost = 0.0  # its own draft: drafted although never worth it
    llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.speculator.num_drafted > 0
    draft = sum(t.model_seconds for t in llm.engine.speculator.draft_model.engine.step_times.totals.values())
    target = sum(t.model_seconds for t in llm.engine.step_times.totals.values())
    assert 0 < draft < target  # the target's model time holds the draft's passes and its own
