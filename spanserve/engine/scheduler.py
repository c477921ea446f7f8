"""Scheduler: which requests run in the next step, and how many tokens each computes.

Continuous batching with chunked prefill (vLLM v1 style): every step has a token budget;
running requests are served first (a decode costs one token, a prefill takes what is left
of the budget), then waiting requests are admitted FCFS. When the block pool runs dry the
most recently admitted running request is preempted: its blocks are freed and it is
recomputed later (its full blocks usually come back as prefix-cache hits).

A prompt with position-independent spans (pic/layout.py) computes its missing spans first,
each as a sub-sequence of its own, then the rest in context, skipping the spans' tokens.
"""

from collections import deque
from dataclasses import dataclass, field

from spanserve.engine.request import Request, RequestStatus
from spanserve.kv.manager import KVCacheManager


@dataclass
class SpanChunk:
    span: int  # index in request.layout.spans
    start: int  # token range computed this step by the span's own sub-sequence
    end: int


@dataclass
class ScheduledRequest:
    request: Request
    end: int  # in-context progress after this step (from request.num_computed_tokens)
    span_chunks: list[SpanChunk] = field(default_factory=list)
    num_tokens: int = 0  # tokens computed this step, all views together

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last known token, so a new one is sampled."""
        req = self.request
        return self.end == req.num_tokens and req.num_computed_tokens < self.end


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        budget = self._schedule_running(scheduled, budget)
        self._admit_waiting(scheduled, budget)
        return scheduled

    def _schedule_running(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            item = plan(req, budget)
            if not item.num_tokens:  # waiting for its link probe (engine._select_links)
                i += 1
                continue
            while not self.kv.allocate_slots(req, item.end):
                victim = self.running.pop()  # newest first: it has the least work to redo
                self._preempt(victim)
                if victim is req:
                    return budget
            scheduled.append(item)
            budget -= item.num_tokens
            i += 1
        return budget

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if req.wait_for is not None and not req.wait_for.is_finished and req.wait_for.is_prefilling:
                skipped.append(req)  # its sibling's prompt blocks will be cache hits soon
                continue
            if not self.kv.admit(req):
                self.waiting.appendleft(req)
                break
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            item = plan(req, budget)
            if item.num_tokens:
                scheduled.append(item)
                budget -= item.num_tokens
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.span_done = [span.start for span in req.layout.spans]
        req.layout.reset_selection()
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def after_step(self, batch: list[ScheduledRequest]) -> None:
        """Account for the tokens the runner just computed."""
        for item in batch:
            for chunk in item.span_chunks:
                item.request.span_done[chunk.span] = chunk.end
            item.request.num_computed_tokens = item.end
            self.kv.cache_computed_blocks(item.request)

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)


def plan(req: Request, budget: int) -> ScheduledRequest:
    """What `req` computes this step within `budget` tokens: unfinished spans first, then in
    context as far as the spans allow."""
    layout, done = req.layout, list(req.span_done)
    item = ScheduledRequest(req, req.num_computed_tokens)
    for s, span in enumerate(layout.spans):
        if done[s] < span.sub_end and item.num_tokens < budget:
            end = min(span.sub_end, done[s] + budget - item.num_tokens)
            item.span_chunks.append(SpanChunk(s, done[s], end))
            item.num_tokens += end - done[s]
            done[s] = end
    if item.num_tokens < budget:
        limit = min(req.num_tokens, layout.ready_limit(done))
        item.end = max(item.end, layout.advance(item.end, budget - item.num_tokens, limit))
        item.num_tokens += layout.count_in_context(req.num_computed_tokens, item.end)
    return item
