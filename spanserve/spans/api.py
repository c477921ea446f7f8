"""Span queries end to end: parse, optimize, tokenize, execute, on either engine front end."""

import asyncio
import json

from spanserve.engine.llm_engine import LLMEngine
from spanserve.outputs import RequestOutput
from spanserve.sampling import SamplingParams
from spanserve.spans.executor import Executor, QueryResult
from spanserve.spans.ir import Node, parse
from spanserve.spans.optimizer import Optimized, Retriever, default_rules, optimize
from spanserve.spans.tokenize import ChatFormat, QueryTokenizer


def as_tree(query) -> Node:
    """A Node from a Node, its JSON form, or JSON text."""
    if isinstance(query, Node):
        return query
    return parse(json.loads(query) if isinstance(query, str) else query)


def prepare(query, retriever: Retriever | None = None, judge_arity: int | None = None) -> Optimized:
    return optimize(as_tree(query), default_rules(retriever, judge_arity))


def query_tokenizer(engine: LLMEngine) -> QueryTokenizer:
    fmt = engine.derived.get("chat_format")
    if fmt is None:
        fmt = engine.derived["chat_format"] = ChatFormat(engine.tokenizer)
    anchor = engine.anchor_tokens if engine.anchor else None
    return QueryTokenizer(fmt, engine.config.block_size, engine.pad_token_id, anchor)


async def run_async(llm, tree: Node, on_root_output=None, cache_salt: str | None = None,
                    tenant: str | None = None) -> QueryResult:
    """Run an optimized query on an AsyncLLM (the server's engine); every call carries `cache_salt`
    (the tenant's cache namespace on a server with keys) and counts in `tenant`'s share of steps."""

    async def complete(prompt: dict, params: SamplingParams, on_output=None) -> RequestOutput:
        final = None
        async for out in llm.generate({**prompt, "cache_salt": cache_salt}, params, tenant=tenant):
            final = out
            if on_output is not None:
                on_output(out)
        return final

    return await Executor(complete, query_tokenizer(llm.engine)).run(tree, on_root_output)


def run_sync(engine: LLMEngine, queries: list, retriever: Retriever | None = None,
             judge_arity: int | None = None) -> list[QueryResult]:
    """Run queries on a synchronous engine (the offline LLM), all at once: the calls they issue
    together share engine steps."""
    trees = [prepare(query, retriever, judge_arity).tree for query in queries]
    driver, tokenizer = _Driver(engine), query_tokenizer(engine)

    async def run_all() -> list[QueryResult]:
        return list(await asyncio.gather(*(Executor(driver.complete, tokenizer).run(tree) for tree in trees)))

    return asyncio.run(driver.drive(run_all()))


class _Driver:
    """Steps a synchronous engine whenever every caller is waiting for a result."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.pending: dict[str, asyncio.Future] = {}

    async def complete(self, prompt: dict, params: SamplingParams, on_output=None) -> RequestOutput:
        group = self.engine.make_group(prompt, params)
        self.engine.add_group(group)
        future = asyncio.get_running_loop().create_future()
        self.pending[group.request_id] = future
        return await future

    async def drive(self, main):
        task = asyncio.ensure_future(main)
        try:
            while not task.done():
                await self._settle()
                for out in self.engine.step() if self.pending else ():
                    if out.finished:
                        self.pending.pop(out.request_id).set_result(out)
            return task.result()
        finally:
            for request_id in list(self.pending):
                self.engine.abort_request(request_id)
            self.pending.clear()

    async def _settle(self, max_rounds: int = 32) -> None:
        """Let every ready coroutine submit its request before the next step batches them."""
        before = -1
        for _ in range(max_rounds):
            if len(self.pending) == before:
                return
            before = len(self.pending)
            await asyncio.sleep(0)
