"""Steps are shared among tenants: the tenant with the least recent work is served first, and a
tenant's priority classes (a session's flash and questions before its other work) order its own
work only, never another tenant's share."""

from helpers import assert_engine_idle, greedy, random_prompt

from spanserve import LLM
from spanserve.engine.request import Priority


def _add(engine, request_id: str, length: int, tenant: str | None, priority=Priority.STATELESS, seed: int = 0):
    group = engine.make_group({"prompt_token_ids": random_prompt(length, seed=seed)}, greedy(4), request_id,
                              priority=priority, tenant=tenant)
    engine.add_group(group)
    return group.children[0]


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_another_tenants_request_comes_before_a_busy_tenants_urgent_work(tiny_llama_path):
    engine = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256, max_num_batched_tokens=64).engine
    busy = [_add(engine, f"a{i}", 200, "a", Priority.SESSION, seed=i) for i in range(4)]
    engine.step()
    engine.step()  # tenant a has computed 128 tokens of its questions
    other = _add(engine, "b", 20, "b", seed=9)
    engine.step()
    assert other.num_computed_tokens == 20  # its whole prompt, ahead of a's more urgent class
    assert sum(req.num_computed_tokens for req in busy) == 128 + 44  # a got what b left of the budget
    _drain(engine)


def test_within_a_tenant_the_urgent_class_comes_first_and_one_tenant_keeps_the_old_order(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256, max_num_batched_tokens=64)
    engine = llm.engine
    for seed, tenant in enumerate(("a", None)):
        plain = _add(engine, f"plain-{tenant}", 100, tenant, seed=10 + seed)  # (no prefix-cache hits)
        engine.step()
        urgent = _add(engine, f"flash-{tenant}", 40, tenant, Priority.FLASH, seed=20 + seed)
        engine.step()
        assert urgent.num_computed_tokens == 40 and plain.num_computed_tokens == 64 + 24
        _drain(engine)
    assert_engine_idle(llm)
