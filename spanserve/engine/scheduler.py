"""Scheduler: which requests run in the next step, and how many tokens each computes.

Continuous batching with chunked prefill (vLLM v1 style): every step has a token budget;
running requests are served first (a decode costs one token, a prefill takes what is left
of the budget), then waiting requests are admitted FCFS. When the block pool runs dry the
most recently admitted running request is preempted: its blocks are freed and it is
recomputed later (its full blocks usually come back as prefix-cache hits).

A prompt with position-independent spans (pic/layout.py) computes its missing spans first,
each as a sub-sequence of its own, then the rest in context, skipping the spans' tokens.

Requests come in lanes: their tenant (the API key's, None offline) and their priority class
(request.Priority). A step serves lane by lane, running requests then waiting ones of each: the
tenants that computed the fewest tokens lately first, and within a tenant its classes, most
urgent first. So one tenant's urgent work (a session's questions and flash re-evaluations) comes
before that tenant's other work, never before another tenant's share. A waiting request that
cannot be admitted preempts its own tenant's running requests of a less urgent class, at the
step boundary; when running requests need blocks the pool does not have, the newest of the lane
served last gives its own. The background class (session ingest) runs only in steps with nothing else to do, a
chunk at a time, paced by BackgroundPace.

A waiting request whose blocks do not fit now does not hold up the smaller ones behind it: up to
ADMIT_LOOKAHEAD of them are tried past it (it keeps its place at the head, and the engine ends
it after admission_timeout_s if room never comes).
"""

from collections import deque
from dataclasses import dataclass, field

from spanserve.engine.request import Priority, Request, RequestStatus
from spanserve.kv.manager import KVCacheManager

ADMIT_LOOKAHEAD = 16  # waiting requests tried past one that does not fit, per lane and step
# A tenant's recent work: the tokens computed for it, decayed by this much per step (about 20
# steps' memory): the lanes of the tenant with the least go first.
USAGE_DECAY = 0.95
Lane = tuple[str | None, Priority]


def lane(req: Request) -> Lane:
    return req.tenant, req.priority


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
    drafts: int = 0  # of its last tokens, how many are a draft the step checks (spanserve/speculative/)

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last known token, so a new one is sampled."""
        req = self.request
        return self.end == req.num_tokens and req.num_computed_tokens < self.end and not req.prefill_only


class WaitQueue:
    """Waiting requests: FIFO within each lane."""

    def __init__(self):
        self._lanes: dict[Lane, deque[Request]] = {}

    def append(self, req: Request) -> None:
        self._lanes.setdefault(lane(req), deque()).append(req)

    def appendleft(self, req: Request) -> None:
        self._lanes.setdefault(lane(req), deque()).appendleft(req)

    def peek(self, of: Lane) -> Request | None:
        """The next request of lane `of` to admit."""
        queue = self._lanes.get(of)
        return queue[0] if queue else None

    def remove(self, req: Request) -> None:
        queue = self._lanes[lane(req)]
        queue.remove(req)
        if not queue:
            del self._lanes[lane(req)]

    def lanes(self) -> list[Lane]:
        return list(self._lanes)

    def __contains__(self, req: Request) -> bool:
        return req in self._lanes.get(lane(req), ())

    def __len__(self) -> int:
        return sum(map(len, self._lanes.values()))

    def __iter__(self):
        return (req for q in list(self._lanes.values()) for req in q)


class BackgroundPace:
    """The size of the next background chunk, and whether its step may stop for an arrival.

    A step of background work alone stops between layers when a request arrives (engine.step),
    and its chunk is computed again later. A stopped chunk halves the next one (down to one
    block), so that chunks come to fit between arrivals; a chunk run to its end doubles it again
    (up to `max_tokens`), for throughput while nothing arrives. After MAX_STOPS_IN_A_ROW stops in
    a row the next chunk runs to its end whatever arrives: a stream of arrivals (even ones that
    compute nothing, like flash hits) slows ingest but cannot starve it."""

    MAX_STOPS_IN_A_ROW = 2

    def __init__(self, max_tokens: int, min_tokens: int):
        self.max_tokens, self.min_tokens = max_tokens, min(min_tokens, max_tokens)
        self.tokens = max_tokens
        self.stops_in_a_row = 0
        self.num_stopped = 0  # steps stopped so far

    @property
    def stoppable(self) -> bool:
        return self.stops_in_a_row < self.MAX_STOPS_IN_A_ROW

    def stopped(self) -> None:
        self.stops_in_a_row += 1
        self.num_stopped += 1
        self.tokens = max(self.min_tokens, self.tokens // 2)

    def ran(self) -> None:
        self.stops_in_a_row = 0
        self.tokens = min(self.max_tokens, self.tokens * 2)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 background_chunk_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.background = BackgroundPace(background_chunk_tokens, kv.block_size)
        self.waiting = WaitQueue()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.usage: dict[str | None, float] = {}  # tenant -> its recent tokens (USAGE_DECAY)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def never_admitted(self, older_than: float) -> list[Request]:
        """Waiting requests that arrived before `older_than` (time.monotonic) and have not started:
        a preempted request started once, and is not among them."""
        return [req for req in self.waiting if req.arrival_time < older_than and req.num_cached_tokens is None]

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        order = self._lane_order()
        rank = {each: i for i, each in enumerate(order)}
        self._yield_to_urgent()
        for each in order:
            if each[1] == Priority.INGEST:  # background: only in a step nothing else needs
                if scheduled:
                    break
                budget = min(budget, self.background.tokens)
            budget = self._schedule_running(scheduled, budget, each, rank)
            budget = self._admit_waiting(scheduled, budget, each)
        self._charge(scheduled)
        return scheduled

    def _lane_order(self) -> list[Lane]:
        """The lanes with work, in the order a step serves them: background last; then the tenant
        with the least recent work first; within a tenant, the most urgent class first."""
        lanes = {lane(req) for req in self.running} | set(self.waiting.lanes())
        return sorted(lanes, key=lambda each: (each[1] == Priority.INGEST, self.usage.get(each[0], 0.0), each[1],
                                               str(each[0])))

    def _charge(self, scheduled: list[ScheduledRequest]) -> None:
        """Each tenant's recent work, with this step's tokens."""
        for tenant in list(self.usage):
            self.usage[tenant] *= USAGE_DECAY
            if self.usage[tenant] < 1:
                del self.usage[tenant]
        for item in scheduled:
            tenant = item.request.tenant
            self.usage[tenant] = self.usage.get(tenant, 0.0) + item.num_tokens

    def _victim(self, rank: dict[Lane, int]) -> Request:
        """Take out the running request to preempt: of the lane served last, the newest (the least
        work to redo)."""
        i = max(range(len(self.running)), key=lambda i: (rank.get(lane(self.running[i]), len(rank)), i))
        return self.running.pop(i)

    def _yield_to_urgent(self) -> None:
        """Preempt a tenant's running requests of a less urgent class (the least urgent, newest
        first) while they keep that tenant's most urgent waiting request out. Classes order a
        tenant's own work only: no request preempts another tenant's to start."""
        for tenant in {tenant for tenant, _ in self.waiting.lanes()}:
            while True:
                lanes = sorted(each for each in self.waiting.lanes() if each[0] == tenant)
                own = [i for i, req in enumerate(self.running) if req.tenant == tenant]
                if not lanes or not own:
                    break
                head, least = self.waiting.peek(lanes[0]), max(own, key=lambda i: (self.running[i].priority, i))
                if self.running[least].priority <= head.priority:
                    break
                if len(self.running) < self.max_num_seqs and self._admit(head):
                    continue
                self._preempt(self.running.pop(least))

    def _schedule_running(self, scheduled: list[ScheduledRequest], budget: int, of: Lane,
                          rank: dict[Lane, int]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if lane(req) != of:
                i += 1
                continue
            item = plan(req, budget)
            if not item.num_tokens:  # waiting for its link probe (engine._select_links)
                i += 1
                continue
            while not self.kv.allocate_slots(req, item.end):
                victim = self._victim(rank)
                self._preempt(victim)
                if victim is req:
                    return budget
                i = self.running.index(req)  # the victim may have come before it
            scheduled.append(item)
            budget -= item.num_tokens
            i += 1
        return budget

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int, of: Lane) -> int:
        skipped: list[Request] = []
        too_big = 0
        while (req := self.waiting.peek(of)) is not None and budget > 0 and len(self.running) < self.max_num_seqs:
            if req.wait_for is not None and not req.wait_for.is_finished and req.wait_for.is_prefilling:
                self.waiting.remove(req)
                skipped.append(req)  # its sibling's prompt blocks will be cache hits soon
                continue
            if not self._admit(req):
                too_big += 1
                if too_big > ADMIT_LOOKAHEAD:
                    break
                self.waiting.remove(req)
                skipped.append(req)  # no room for it now: the smaller ones behind it may fit
                continue
            item = plan(req, budget)
            if item.num_tokens:
                scheduled.append(item)
                budget -= item.num_tokens
        for req in reversed(skipped):
            self.waiting.appendleft(req)
        return budget

    def _admit(self, req: Request) -> bool:
        """Move the head of its class from waiting to running, if its blocks fit."""
        if not self.kv.admit(req):
            return False
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

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
