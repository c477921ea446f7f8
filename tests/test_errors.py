"""Everything a caller can get wrong fails fast with an error that names the problem."""

import re

import pytest
from helpers import assert_engine_idle, greedy, random_prompt

from spanserve import LLM, InvalidRequestError, SamplingParams
from spanserve.errors import CacheFullError, ModelNotFoundError, PromptTooLongError, SpanserveError

MAX_MODEL_LEN = 64
NUM_BLOCKS = 8  # 8 blocks of 16 tokens: 128 tokens of KV in the whole pool


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)


# ---- the model ------------------------------------------------------------------------------


def test_missing_model_path_raises_model_not_found_naming_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(model=str(missing))


def test_unknown_model_name_raises_model_not_found_naming_it():
    with pytest.raises(ModelNotFoundError, match="org/unknown-model-xyz"):
        LLM(model="org/unknown-model-xyz")


def test_directory_without_weights_raises_model_not_found_naming_the_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=re.escape(str(tmp_path))):
        LLM(model=str(tmp_path))


def test_model_not_found_is_a_file_not_found_error_and_a_spanserve_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        LLM(model=str(tmp_path / "missing"))
    assert isinstance(info.value, SpanserveError)


def test_max_model_len_beyond_the_model_limit_is_rejected(tiny_llama_path):
    with pytest.raises(InvalidRequestError, match="max_model_len 1024 exceeds the model's 512"):
        LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=4, max_model_len=1024)


# ---- unknown keywords and bad engine settings ---------------------------------------------------


def test_unknown_llm_keyword_is_rejected_by_name_before_loading_anything():
    with pytest.raises(InvalidRequestError, match="unknown EngineConfig keyword.*blok_size"):
        LLM(model="/does/not/matter", blok_size=16)


def test_unknown_sampling_keyword_is_rejected_by_name():
    with pytest.raises(InvalidRequestError, match="unknown SamplingParams keyword.*max_token") as info:
        SamplingParams(max_token=5)
    assert "max_tokens" in str(info.value)  # the message lists the valid keywords


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "float8"}, "unknown dtype 'float8'"),
    ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
    ({"block_size": 0}, "block_size, max_num_seqs, max_num_batched_tokens and background_chunk_tokens must be >= 1"),
    ({"session_tenant_share": 0}, r"session_tenant_share must be in \(0, 1\], got 0"),
])
def test_bad_engine_settings_are_rejected(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(model="/does/not/matter", **kwargs)


# ---- sampling parameters --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"temperature": -0.5}, r"temperature must be >= 0, got -0.5"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -2}, "top_k must be -1, 0 .* got -2"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens must be in \[0, max_tokens\], got 20"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be in \[0.01, 100\], got 0"),
    ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\], got 3"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
    ({"stop": [""]}, "stop must be a non-empty string"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_invalid_sampling_parameter_is_rejected_with_its_value(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


# ---- prompts --------------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len_is_rejected_not_truncated(llm):
    with pytest.raises(PromptTooLongError) as info:
        llm.generate({"prompt_token_ids": random_prompt(100, seed=1)}, greedy(1))
    assert (info.value.num_tokens, info.value.max_len) == (100, MAX_MODEL_LEN)
    assert "100 tokens" in str(info.value) and f"max_model_len={MAX_MODEL_LEN}" in str(info.value)
    assert_engine_idle(llm)


def test_prompt_of_exactly_max_model_len_tokens_is_rejected(llm):
    with pytest.raises(PromptTooLongError):
        llm.generate({"prompt_token_ids": random_prompt(MAX_MODEL_LEN, seed=2)}, greedy(1))


def test_prompt_one_short_of_max_model_len_gets_one_token_and_finishes_by_length(llm):
    out = llm.generate({"prompt_token_ids": random_prompt(MAX_MODEL_LEN - 1, seed=3)}, greedy(16))
    assert (len(out[0].outputs[0].token_ids), out[0].outputs[0].finish_reason) == (1, "length")


def test_one_bad_prompt_rejects_the_whole_batch_before_any_runs(llm):
    good, too_long = random_prompt(10, seed=4), random_prompt(100, seed=5)
    admitted_before = llm.engine.kv.queried_tokens  # grows when a request is admitted
    with pytest.raises(PromptTooLongError):
        llm.generate([{"prompt_token_ids": good}, {"prompt_token_ids": too_long}], greedy(4))
    assert llm.engine.kv.queried_tokens == admitted_before
    assert_engine_idle(llm)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "prompt is empty"),
    ("", "prompt is empty"),
    ({"prompt_token_ids": [5, 49152]}, r"prompt_token_ids must be integers in \[0, 49152\)"),
    ({"prompt_token_ids": [5, -1]}, r"prompt_token_ids must be integers in \[0, 49152\)"),
    ({"prompt_token_ids": [5, 7.0]}, r"prompt_token_ids must be integers in \[0, 49152\)"),
    ({"prompt_token_ids": [5, True]}, r"prompt_token_ids must be integers in \[0, 49152\)"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "a prompt is a string"),
    ({"text": "a"}, "a prompt is a string"),
])
def test_malformed_prompt_is_rejected(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt, greedy(1))


def test_prompt_of_the_wrong_type_is_rejected_by_the_engine(llm):
    with pytest.raises(InvalidRequestError, match="a prompt is a string"):
        llm.engine.add_request(42, greedy(1))


def test_sampling_params_count_must_match_the_prompts(llm):
    with pytest.raises(InvalidRequestError, match="got 2 sampling_params for 1 prompts"):
        llm.generate(["a"], [greedy(1), greedy(1)])


def test_chat_message_without_content_is_rejected(llm):
    with pytest.raises(InvalidRequestError, match="'role' and 'content'"):
        llm.chat([{"role": "user"}])


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("hello", greedy(2), request_id="same")
    with pytest.raises(InvalidRequestError, match="request id 'same' is already running"):
        engine.add_request("hello", greedy(2), request_id="same")
    engine.abort_request("same")
    assert_engine_idle(llm)


# ---- the KV pool ----------------------------------------------------------------------------


def test_request_needing_more_blocks_than_the_pool_raises_cache_full(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=4)  # 64 tokens of KV
    with pytest.raises(CacheFullError, match="needs 5 KV blocks but the pool has 4"):
        llm.generate({"prompt_token_ids": random_prompt(40, seed=6)}, greedy(40))
    assert_engine_idle(llm)


def test_request_filling_the_pool_exactly_is_served(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=4)
    out = llm.generate({"prompt_token_ids": random_prompt(40, seed=7)}, greedy(24))
    assert len(out[0].outputs[0].token_ids) == 24


@pytest.mark.parametrize("policy, max_tokens, fits", [
    ({"link_policy": "blend"}, 32, True),  # 6 blocks of its own, 2 scratch copies of its span: 8
    ({"link_policy": "blend"}, 48, False),  # 7 + 2
    ({"link_policy": "none", "focus_tokens": 16}, 48, True),  # 7 + 1 spare for the block it links
    ({"link_policy": "none"}, 48, True)])
def test_a_link_probes_blocks_count_toward_what_a_request_needs(tiny_llama_path, policy, max_tokens, fits):
    """A request that could never be admitted beside its probe's blocks is refused at once, not
    left waiting forever; one that fits exactly is served."""
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=8, span_anchor=False)
    p = {"prompt_token_ids": random_prompt(64, seed=8), "spans": [[16, 48]]}
    if fits:
        assert len(llm.generate(p, greedy(max_tokens, **policy))[0].outputs[0].token_ids) == max_tokens
    else:
        with pytest.raises(CacheFullError, match="needs 9 KV blocks \\(of which 2 for its link policy's probe\\)"):
            llm.generate(p, greedy(max_tokens, **policy))
    assert_engine_idle(llm)


def test_cache_full_error_is_an_invalid_request_error():
    assert issubclass(CacheFullError, InvalidRequestError)
    assert issubclass(PromptTooLongError, InvalidRequestError)
