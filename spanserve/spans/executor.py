"""Run an optimized span query: every `g` once, inner calls before the calls that read them,
independent calls at the same time (one engine batch)."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from spanserve.errors import SpanserveError
from spanserve.outputs import RequestOutput
from spanserve.sampling import SamplingParams
from spanserve.spans.ir import Generate, Node, QueryError
from spanserve.spans.tokenize import QueryTokenizer

log = logging.getLogger(__name__)

# complete(prompt, params, on_output): run one request to the end; on_output, if given, sees
# every cumulative output on the way (to stream the root call).
Complete = Callable[..., Awaitable[RequestOutput]]


@dataclass
class CallStats:
    path: str  # where the g sits in the optimized tree
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float | None
    # From the moment its inputs were ready (the last inner call's last token; its arrival if
    # it has none) to its first token: TTFT plus what ran in between (the inner calls' last
    # blocks), as a caller of the query waits for it.
    ready_s: float | None = None


@dataclass
class QueryResult:
    text: str  # the root call's (first) output
    texts: list[str]  # all n outputs of the root call
    calls: list[CallStats] = field(default_factory=list)  # inner calls first, the root last
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)  # token ids of each call, by path

    def to_json(self) -> dict:
        return {"text": self.text, "texts": self.texts, "calls": [asdict(c) for c in self.calls]}


class Executor:
    def __init__(self, complete: Complete, tokenizer: QueryTokenizer):
        self.complete, self.tokenizer = complete, tokenizer

    async def run(self, tree: Node, on_root_output: Callable[[RequestOutput], None] | None = None) -> QueryResult:
        if not isinstance(tree, Generate):
            raise QueryError("$", "the root of a span query is a g or a chat")
        run = _Run(self, on_root_output)
        final = await run.call(tree, "$")
        outputs = {c.path: run.outputs[id(node)] for c, node in zip(run.calls, run.nodes)}
        return QueryResult(final.outputs[0].text, [c.text for c in final.outputs], run.calls, outputs)


class _Run:
    """One execution: each g node runs once, however many callers wait for it."""

    def __init__(self, executor: Executor, on_root_output=None):
        self.executor, self.on_root_output = executor, on_root_output
        self.tasks: dict[int, asyncio.Task] = {}
        self.outputs: dict[int, list[list[int]]] = {}
        self.finished: dict[int, float] = {}  # monotonic time each call's generation ended
        self.calls: list[CallStats] = []
        self.nodes: list[Generate] = []  # the node of each entry in calls

    def call(self, node: Generate, path: str) -> asyncio.Task:
        if id(node) not in self.tasks:
            self.tasks[id(node)] = asyncio.ensure_future(self._call(node, path))
        return self.tasks[id(node)]

    async def _call(self, node: Generate, path: str) -> RequestOutput:
        inner = [(self.call(g, p), g) for p, g in inner_calls(node.input, f"{path}.input")]
        prefetch = [self._prefill_static_prefix(node, path)] if inner else []
        await asyncio.gather(*(task for task, _ in inner), *prefetch)
        ready = max((self.finished[id(g)] for _, g in inner), default=None)
        out = await self._generate(node, path, ready)
        if path != "$" and not node.bare:
            await self._complete_last_blocks(node)
        return out

    async def _prefill_static_prefix(self, node: Generate, path: str) -> None:
        """Prefill the start of the call's prompt that its inner calls do not change (a judge's
        system message) while they run, so the call finds it cached."""
        ids, spans = self.executor.tokenizer.static_prefix(node, exposed=path != "$" and not node.bare)
        if not ids:
            return
        prompt = {"prompt_token_ids": ids, "spans": [list(s) for s in spans]}
        try:
            await self.executor.complete(prompt, SamplingParams(max_tokens=1, temperature=0))
        except SpanserveError as exc:  # only a head start: the call computes the prefix itself
            log.info("static prefix of %s not prefilled: %s", path, exc)

    async def _complete_last_blocks(self, node: Generate) -> None:
        """Compute the call's KV as its caller will read it, a span after the anchor (input,
        output, assistant footer, padding), so the caller reuses every block of the call: the span
        query paper crops the last partial block instead. Runs as a prefill of that span (and one
        token after it, which samples) under the engine's link policy: with `none` its blocks but
        the last are the call's own, hits; with `comb` the encoder writes them all (a plug-in's
        span KV is not the decoder's), here as each call finishes rather than in the caller's
        prompt."""
        prefill = SamplingParams(max_tokens=1, temperature=0)
        tokenizer = self.executor.tokenizer
        start = len(tokenizer.anchor)
        prompts = [{"prompt_token_ids": seq + [tokenizer.pad_id], "spans": [[start, len(seq)]]}
                   for seq in tokenizer.exposed(node, self.outputs)]
        await asyncio.gather(*(self.executor.complete(prompt, prefill) for prompt in prompts))

    async def _generate(self, node: Generate, path: str, ready: float | None = None) -> RequestOutput:
        exposed = path != "$" and not node.bare  # a caller reads it as a span
        ids, spans = self.executor.tokenizer.prompt(node, self.outputs, exposed)
        params = SamplingParams(max_tokens=node.max_tokens, temperature=node.temperature, n=node.n,
                                seed=node.seed, stop=list(node.stop), structured_outputs=node.structured())
        start = time.monotonic()
        prompt = {"prompt_token_ids": ids, "spans": [list(s) for s in spans]}
        out = await self.executor.complete(prompt, params, self.on_root_output if path == "$" else None)
        self.outputs[id(node)] = [c.token_ids for c in out.outputs]
        metrics = out.metrics
        self.finished[id(node)] = metrics.finish_time if metrics and metrics.finish_time else time.monotonic()
        first = metrics.first_token_time if metrics and metrics.first_token_time else time.monotonic()
        ttft = first - (metrics.arrival_time if metrics else start)
        self.nodes.append(node)
        self.calls.append(CallStats(path, len(ids), out.num_cached_tokens,
                                    sum(len(c.token_ids) for c in out.outputs), ttft,
                                    first - ready if ready is not None else ttft))
        return out


def inner_calls(node: Node, path: str):
    """(path, g) of the calls directly inside `node` (not those inside another g)."""
    if isinstance(node, Generate):
        yield path, node
        return
    kind = type(node).__name__.lower()
    for i, child in enumerate(node.children):
        yield from inner_calls(child, f"{path}.{kind}[{i}]")
