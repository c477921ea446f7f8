"""Scheduler: which requests run in the next step, and how many tokens each computes.

Continuous batching with chunked prefill (vLLM v1 style): every step has a token budget;
running requests are served first (a decode costs one token, a prefill takes what is left
of the budget), then waiting requests are admitted FCFS. When the block pool runs dry the
most recently admitted running request is preempted: its blocks are freed and it is
recomputed later (its full blocks usually come back as prefix-cache hits).
"""

from collections import deque
from dataclasses import dataclass

from spanserve.engine.request import Request, RequestStatus
from spanserve.kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last known token, so a new one is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


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
            num_tokens = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_tokens):
                victim = self.running.pop()  # newest first: it has the least work to redo
                self._preempt(victim)
                if victim is req:
                    return budget
            scheduled.append(ScheduledRequest(req, num_tokens))
            budget -= num_tokens
            i += 1
        return budget

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if req.wait_for is not None and not req.wait_for.is_finished and req.wait_for.is_prefilling:
                skipped.append(req)  # its sibling's prompt blocks will be cache hits soon
                continue
            cached = self.kv.cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            num_tokens = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_tokens, cached):
                self.waiting.appendleft(req)
                break
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_tokens))
            budget -= num_tokens
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def after_step(self, batch: list[ScheduledRequest]) -> None:
        """Account for the tokens the runner just computed."""
        for item in batch:
            item.request.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(item.request)

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
