"""Span queries on a model: tokenization checked token by token, execution on a tiny Llama."""

import pytest
from helpers import assert_engine_idle

from spanserve import LLM
from spanserve.spans.api import prepare, query_tokenizer
from spanserve.spans.ir import cross, g, plus, system, user
from spanserve.spans.tokenize import ChatFormat

BS = 16


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    """Span KV reused as cached (link policy none), so a cache hit counts every span token: auto's
    focus probe would recompute a few blocks of a span in context (test_focus.py)."""
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=512, link_policy="none")


@pytest.fixture(scope="module")
def fmt(llm):
    return ChatFormat(llm.get_tokenizer())


def encode(llm, text):
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_chat_format_renders_messages_as_the_template_does(llm, fmt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    whole = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ours = fmt.message("system", "Be brief.") + fmt.message("user", "Hi there") + fmt.generation_prompt
    assert ours == encode(llm, whole)


def test_a_rag_query_tokenizes_into_padded_block_aligned_spans(llm, fmt):
    tree = prepare(g(cross(system("S"), plus(user("doc A " * 5), user("doc B")), user("Q?")))).tree
    ids, spans = query_tokenizer(llm.engine).prompt(tree, {})
    head = fmt.message("system", "S")
    doc_a, doc_b = fmt.message("user", "doc A " * 5), fmt.message("user", "doc B")
    pad = llm.engine.pad_token_id

    def padded(seq):
        return seq + [pad] * (-len(seq) % BS)

    expected = padded(head) + padded(doc_a) + padded(doc_b) + fmt.message("user", "Q?") + fmt.generation_prompt
    assert ids == expected
    a_start = len(padded(head))
    b_start = a_start + len(padded(doc_a))
    assert spans == [(a_start, b_start), (b_start, b_start + len(padded(doc_b)))]
    assert all(start % BS == 0 and end % BS == 0 for start, end in spans)


def test_a_judge_query_shows_each_candidate_after_its_prompt_as_generated(llm, fmt):
    inner = [g(user(f"idea {i}"), max_tokens=5) for i in range(2)]
    tree = prepare(g(cross(system("judge"), plus(*inner), user("best?")))).tree
    outputs = {id(c.items[1]): [[100 + i, 101, 2]] for i, c in enumerate(tree.input.items[1].items)}
    ids, spans = query_tokenizer(llm.engine).prompt(tree, outputs)
    for i, (start, end) in enumerate(spans):
        output = fmt.output([100 + i, 101, 2])  # the inner call's own tokens, not re-tokenized text
        assert output[:len(fmt.generation_prompt) + 3] == fmt.generation_prompt + [100 + i, 101, 2]
        candidate = fmt.message("user", f"idea {i}") + output
        assert ids[start:start + len(candidate)] == candidate
        assert set(ids[start + len(candidate):end]) <= {llm.engine.pad_token_id}


def test_the_static_prefix_is_the_prompt_up_to_the_first_span_that_reads_an_inner_call(llm):
    tokenizer = query_tokenizer(llm.engine)
    tree = prepare(judge_query(plus)).tree
    ids, spans = tokenizer.prompt(tree, _outputs_from_tokens(tree, [[7, 8, 9]]))
    prefix, prefix_spans = tokenizer.static_prefix(tree)
    assert prefix == ids[:spans[0][0]] and prefix_spans == [] and len(prefix) % BS == 0
    assert tokenizer.static_prefix(prepare(g(plus(*judge_query(plus).input.items[1].items))).tree) == ([], [])
    assert tokenizer.static_prefix(prepare(g(cross(system("S"), user("Q")))).tree) == ([], [])


def _outputs_from_tokens(tree, outputs):
    from spanserve.spans.executor import inner_calls

    return {id(node): outputs for _, node in inner_calls(tree.input, "$.input")}


def record_batches(llm) -> list[list[str]]:
    scheduler, batches = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        batches.append([item.request.request_id for item in batch if item.request.is_prefilling])
        return batch

    scheduler.schedule = recording
    return batches


def judge_query(join):
    generators = [g(user(f"Write idea number {i}."), max_tokens=20, temperature=0.5, seed=i) for i in range(4)]
    return g(cross(system("You judge ideas."), join(*generators), user("Which idea is best?")), max_tokens=8)


def test_the_judge_reuses_every_inner_prompt_and_output_and_inner_calls_share_a_batch(llm):
    batches = record_batches(llm)
    result = llm.run_query(judge_query(plus))
    inner, judge = result.calls[:4], result.calls[4]
    assert len({c.path for c in inner}) == 4 and judge.path == "$"
    # The four generators and the judge's static prefix (its system message) prefilled in one step.
    assert any(len(b) == 5 for b in batches)
    tokenizer = query_tokenizer(llm.engine)
    tree = prepare(judge_query(plus)).tree
    span_tokens = sum(end - start for start, end in tokenizer.prompt(tree, _outputs_from(result, tree))[1])
    prefix = len(tokenizer.static_prefix(tree)[0])
    assert prefix > 0
    assert judge.cached_tokens == prefix + span_tokens  # and every block of every candidate span was a hit
    assert all(c.ready_s == c.ttft_s for c in inner) and judge.ready_s >= judge.ttft_s > 0
    anchor = len(tokenizer.anchor)  # inner calls start with the span anchor, which spans leave out
    assert anchor and judge.cached_tokens >= sum(c.prompt_tokens - anchor + c.generated_tokens for c in inner) - 4
    assert_engine_idle(llm)


def _outputs_from(result, tree):
    """Re-run the (deterministic, seeded) inner calls' tokenization with the recorded outputs."""
    from spanserve.spans.executor import inner_calls

    calls = dict(inner_calls(tree.input, "$.input"))
    return {id(node): result.outputs[path] for path, node in calls.items()}


def test_with_cross_instead_of_plus_the_judge_gets_no_such_reuse(llm):
    llm.engine.kv.pool.reset_cache()
    result = llm.run_query(judge_query(cross))
    static = len(query_tokenizer(llm.engine).static_prefix(prepare(judge_query(cross)).tree)[0])
    assert result.calls[-1].cached_tokens == static < BS  # at most a prefetched system message
    assert_engine_idle(llm)


def test_a_list_of_queries_runs_together_with_the_results_of_each_alone(llm):
    queries = [judge_query(plus), g(cross(system("Be brief."), user("Name a colour.")), max_tokens=6)]
    alone = [llm.run_query(q).text for q in queries]
    batches = record_batches(llm)
    together = llm.run_query(queries)
    assert [r.text for r in together] == alone
    assert any(len(b) == 6 for b in batches)  # both queries' first calls (and the judge's prefix) shared a step
    assert_engine_idle(llm)


def test_a_failed_static_prefix_prefill_only_costs_its_head_start(llm):
    """The prefix prefill is an optimization: a full cache there must not fail the query."""
    import asyncio

    from spanserve.errors import CacheFullError
    from spanserve.spans.api import _Driver
    from spanserve.spans.executor import Executor

    llm.engine.kv.pool.reset_cache()
    expected = llm.run_query(judge_query(plus)).text
    llm.engine.kv.pool.reset_cache()
    tokenizer, driver = query_tokenizer(llm.engine), _Driver(llm.engine)
    tree = prepare(judge_query(plus)).tree
    prefix = tokenizer.static_prefix(tree)[0]

    async def complete(prompt, params, on_output=None):
        if prompt["prompt_token_ids"] == prefix:
            raise CacheFullError("no room")
        return await driver.complete(prompt, params, on_output)

    result = asyncio.run(driver.drive(Executor(complete, tokenizer).run(tree)))
    assert result.text == expected and result.calls[-1].cached_tokens < len(prefix) + sum(
        end - start for start, end in tokenizer.prompt(tree, _outputs_from(result, tree))[1])
    assert_engine_idle(llm)
