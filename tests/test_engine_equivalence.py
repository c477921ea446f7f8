"""How the engine schedules work never changes what it generates (tiny Llama, float32, greedy).

The reference is the plainest run: one prompt at a time, no prefix cache, no chunking, a pool
far larger than needed. Every other configuration must produce the same tokens.
"""

import pytest
from helpers import assert_engine_idle, greedy, random_prompt, token_ids

from spanserve import LLM, SamplingParams

MAX_TOKENS = 24
SHARED_PREFIX = random_prompt(40, seed=100)
# Eight prompts of different lengths; four share a 40-token prefix (two full 16-token blocks).
PROMPTS = [
    random_prompt(5, seed=1),
    random_prompt(17, seed=2),
    SHARED_PREFIX + random_prompt(3, seed=3),
    random_prompt(64, seed=4),
    SHARED_PREFIX + random_prompt(30, seed=5),
    random_prompt(100, seed=6),
    SHARED_PREFIX,
    SHARED_PREFIX + random_prompt(77, seed=7),
]


def make_llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", **{"num_blocks": 256, **kwargs})


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(MAX_TOKENS))
    assert_engine_idle(llm)
    return outputs


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return make_llm(tiny_llama_path)


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> list[list[list[int]]]:
    llm = make_llm(tiny_llama_path, enable_prefix_caching=False)
    return [token_ids(run(llm, [p]))[0] for p in PROMPTS]


def test_reference_outputs_are_full_length_and_prompt_dependent(reference):
    assert all(len(out[0]) == MAX_TOKENS for out in reference)
    # Prompts 2, 4 and 6 share their first 40 tokens yet continue differently.
    assert len({tuple(reference[i][0]) for i in (2, 4, 6)}) == 3


def test_batching_all_prompts_together_equals_one_at_a_time(tiny_llama_path, reference):
    llm = make_llm(tiny_llama_path, enable_prefix_caching=False)
    assert token_ids(run(llm, PROMPTS)) == reference


def test_prefix_cache_hits_do_not_change_outputs(llm, reference):
    first = run(llm, PROMPTS)
    second = run(llm, PROMPTS)
    assert token_ids(first) == reference
    assert token_ids(second) == reference
    assert all(out.num_cached_tokens > 0 for out in second[1:])  # all but the 5-token prompt hit


@pytest.mark.parametrize("budget", [16, 32])
def test_chunked_prefill_equals_unchunked(tiny_llama_path, reference, budget):
    llm = make_llm(tiny_llama_path, max_num_batched_tokens=budget)
    assert token_ids(run(llm, PROMPTS)) == reference


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_pool_that_fits_one_request_preempts_and_still_equals_the_reference(
        tiny_llama_path, reference, prefix_caching):
    # The longest request needs ceil((117 + 24) / 16) = 9 blocks: the pool holds just that.
    llm = make_llm(tiny_llama_path, num_blocks=9, enable_prefix_caching=prefix_caching)
    outputs = run(llm, PROMPTS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [out.outputs[0].finish_reason for out in outputs] == ["length"] * len(PROMPTS)
    assert token_ids(outputs) == reference


def test_every_step_stays_within_the_token_budget_and_the_sequence_limit(tiny_llama_path, reference, monkeypatch):
    llm = make_llm(tiny_llama_path, max_num_batched_tokens=32, max_num_seqs=3)
    steps = []
    execute = llm.engine.runner.execute

    def recording_execute(batch, stop=None):
        steps.append([item.num_tokens for item in batch])
        return execute(batch, stop)

    monkeypatch.setattr(llm.engine.runner, "execute", recording_execute)
    assert token_ids(run(llm, PROMPTS)) == reference
    assert max(sum(step) for step in steps) == 32
    assert max(len(step) for step in steps) == 3


def test_max_num_seqs_one_serializes_requests_without_changing_outputs(tiny_llama_path, reference):
    llm = make_llm(tiny_llama_path, max_num_seqs=1)
    assert token_ids(run(llm, PROMPTS)) == reference


@pytest.mark.parametrize(
    "prompt_len, expected_cached",
    [(15, 0), (16, 0), (17, 16), (40, 32), (48, 32), (49, 48)],
)
def test_repeated_prompt_reuses_every_full_block_except_one_holding_the_last_token(
        llm, prompt_len, expected_cached):
    # The last prompt token is always recomputed (its logits give the first output token), so a
    # block is reused only if it ends before the last prompt token: (len - 1) // 16 blocks.
    prompt = random_prompt(prompt_len, seed=1000 + prompt_len)
    first = run(llm, [prompt], greedy(1))
    again = run(llm, [prompt], greedy(1))
    assert (first[0].num_cached_tokens, again[0].num_cached_tokens) == (0, expected_cached)


def test_a_different_prompt_with_the_same_first_20_tokens_reuses_one_block(llm):
    prompt = random_prompt(40, seed=2000)
    run(llm, [prompt], greedy(1))
    out = run(llm, [prompt[:20] + random_prompt(20, seed=2001)], greedy(1))
    assert out[0].num_cached_tokens == 16


def test_generated_tokens_are_cached_for_the_next_turn(llm):
    prompt = random_prompt(20, seed=3000)
    first = run(llm, [prompt], greedy(20))
    # 40 tokens were seen but only 39 computed (the last sampled one never went through the
    # model): blocks 0 and 1 are cached.
    follow_up = prompt + first[0].outputs[0].token_ids
    assert run(llm, [follow_up], greedy(1))[0].num_cached_tokens == 32


def test_cache_salt_isolates_the_prefix_cache(llm):
    prompt = random_prompt(40, seed=4000)
    run(llm, [prompt], greedy(1))
    salted = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, greedy(1))
    salted_again = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, greedy(1))
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, greedy(1))
    assert [salted[0].num_cached_tokens, salted_again[0].num_cached_tokens, other[0].num_cached_tokens] == [0, 32, 0]


def test_disabled_prefix_cache_reports_no_cached_tokens(tiny_llama_path):
    llm = make_llm(tiny_llama_path, enable_prefix_caching=False, num_blocks=16)
    prompt = random_prompt(40, seed=5000)
    outputs = [run(llm, [prompt], greedy(1))[0] for _ in range(2)]
    assert [out.num_cached_tokens for out in outputs] == [0, 0]
    assert llm.engine.kv.pool.num_cached == 0


def test_n_children_share_the_prompt_blocks_and_all_finish(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    hits_before = llm.engine.kv.hit_tokens
    out = run(llm, [random_prompt(40, seed=6000)], params)[0]
    # Children 1 and 2 wait for child 0's prefill, then reuse its two full prompt blocks.
    assert llm.engine.kv.hit_tokens - hits_before == 2 * 32
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert [len(c.token_ids) for c in out.outputs] == [8] * 3
    assert out.finished


def test_abort_of_a_running_request_frees_all_its_blocks(llm):
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": random_prompt(70, seed=7000)}, greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.kv.pool.num_free < engine.kv.pool.num_blocks
    engine.abort_request(request_id)
    assert_engine_idle(llm)
    assert engine.step() == []


def test_abort_of_a_waiting_request_removes_it_from_the_queue(llm):
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": random_prompt(10, seed=7100)}, greedy(5))
    assert len(engine.scheduler.waiting) == 1
    engine.abort_request(request_id)
    assert_engine_idle(llm)


def test_abort_of_an_n2_request_frees_both_children(llm):
    engine = llm.engine
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True)
    request_id = engine.add_request({"prompt_token_ids": random_prompt(30, seed=7200)}, params)
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 2
    engine.abort_request(request_id)
    assert_engine_idle(llm)


def test_abort_leaves_other_requests_running_to_the_same_result(llm, reference):
    engine = llm.engine
    keep = engine.add_request({"prompt_token_ids": PROMPTS[3]}, greedy(MAX_TOKENS))
    drop = engine.add_request({"prompt_token_ids": PROMPTS[5]}, greedy(MAX_TOKENS))
    engine.step()
    engine.abort_request(drop)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert list(finished) == [keep]
    assert finished[keep].outputs[0].token_ids == reference[3][0]
    assert_engine_idle(llm)
