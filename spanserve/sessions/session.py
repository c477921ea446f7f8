"""Session: one long-lived sequence for streaming data (papers/stateful-streaming-sessions.txt).

Three regions, in token order (format.py):
0. frozen: the instructions, computed once;
1. data: appended as it arrives, computed in the background by ingest requests (the lowest
   priority class). Past `retention_tokens` (regions 0 and 1 together) the oldest whole blocks of
   data are dropped and the rest move back: their keys are rotated by RoPE (exact: a rotation by
   d composes with the one by p into the one by p + d), their values do not depend on position;
2. per question: the question and its answer, computed by a query request that continues from
   regions 0-1 (their blocks, shared, never copied) and frees only its own blocks.

The session owns the blocks of regions 0-1, one pool reference each. Each request it starts holds
a reference of its own to the blocks it continues from (a HeldContext), from creation to its end:
data can be dropped and moved while a question is still being answered, since a block someone
else still reads is moved into a copy (copy on write) and the reader keeps the old one.

An ingest computes the data and, after it, the header every question starts with (the paper's
ready position): a question computes only its own tokens. The blocks holding the end of the data
and the header are rewritten by the next ingest, so a request continuing from them gets private
copies (one or two blocks), and an ingest writes into copies too, which replace the session's
when it finishes: the session's state changes at once, between two steps.

Registered ("flash") questions are answered again after each ingest, at the most urgent
priority; their answers are kept per data version and pushed to subscribers. So is the
ready-position assessment of a session that asks for speculative exit (ready.py).

Everything here runs on the engine's thread.
"""

import logging
import re
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from spanserve.engine import text_bound
from spanserve.engine.request import HeldContext, Priority, Request
from spanserve.errors import (
    BacklogFullError,
    CacheFullError,
    InvalidRequestError,
    InvalidSessionError,
    SessionClosedError,
    SessionFailedError,
    SessionFullError,
)
from spanserve.kv.block_pool import Block
from spanserve.sampling import SamplingParams
from spanserve.sessions.ready import PARAMS as READY_PARAMS
from spanserve.sessions.ready import ReadyExit

log = logging.getLogger(__name__)
INGEST_TOKENS = 1024  # data one ingest request computes (the scheduler splits it into chunks)
# An eviction drops this much of the data window beyond what it must, so that a key is moved
# (rotated and rounded) a bounded number of times, about 1 / EVICT_FRACTION, over its life.
EVICT_FRACTION = 0.125
SESSION_ID = re.compile(r"sess-[0-9a-f]{32}")  # what Session ids look like (they name files)
BACKLOG_FACTOR = 4  # data waiting to be computed, in retentions: past it an append is refused


@dataclass
class Flash:
    """A registered question and its latest answer."""

    question: str
    tokens: list[int]
    version: int = -1  # data version the answer is for
    answer: str | None = None
    running: object | None = None  # the RequestGroup answering it now
    asking: int = -1  # the data version it sees

    def record(self, output) -> None:
        """Keep the answer a finished request computed."""
        self.version, self.answer = self.asking, output.outputs[0].text


@dataclass
class Answer:
    """What a question to a session returns."""

    text: str
    version: int  # the data version it saw: every append up to this one
    flash_hit: bool = False  # a registered question's kept answer: no forward pass
    speculative: bool = False  # the ready position's assessment (ready.py): no forward pass, question unread
    output: object | None = None  # the RequestOutput, when it was computed


@dataclass
class Question:
    """A question being computed: its request group and the data version it sees."""

    group: object
    version: int


@dataclass
class SessionState:
    """Everything that defines a session's sequence (what save() writes)."""

    tokens: list[int]  # regions 0-1 as computed: block i holds tokens[16 i: 16 i + 16]
    num_frozen: int  # region 0, whole blocks
    pending: list[int]  # appended, not computed yet
    retention_tokens: int
    appended: int = 0  # tokens ever appended (region 0 counts as the first append, version 0)
    evicted: int = 0  # data tokens dropped so far
    version: int = 0  # of the last append
    version_ends: deque = field(default_factory=deque)  # (version, appended after it), not yet visible
    visible_version: int = 0
    ready: bool = False  # the question header is computed after the data (the ready position)


class Session:
    def __init__(self, engine, state: SessionState, tenant: str | None = None, session_id: str | None = None,
                 flash: list[str] = (), flash_params: SamplingParams | None = None,
                 ready_exit: ReadyExit | None = None):
        self.engine, self.state, self.tenant = engine, state, tenant
        self.ready_exit = ready_exit
        self.id = session_id or f"sess-{uuid.uuid4().hex}"
        self.blocks: list[Block] = []
        self.closed = False
        self.failure: str | None = None  # why its background work stopped (fail())
        self.flash_params = flash_params or SamplingParams(temperature=0.0, max_tokens=64)
        self.flash: dict[str, Flash] = {}
        self._subscribers: list[Callable[[dict], None]] = []
        self._ingest = None  # the RequestGroup computing data now
        for question in flash:
            self.register(question)
        if ready_exit is not None:
            self._check_fits("the ready position's opening", len(engine.sessions.format.answer_opening),
                             READY_PARAMS.max_tokens)

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def pool(self):
        return self.engine.kv.pool

    # ---- data -----------------------------------------------------------------------------

    def append(self, text: str) -> int:
        """Queue data; returns its version. It is computed in the background."""
        self.check_usable()
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("data must be a non-empty string")
        self.check_data_size(len(text))
        return self.append_tokens(self.engine.sessions.format.data(text))

    def check_data_size(self, num_chars: int) -> None:
        """Refuse, before it is tokenized, data that is too long for the backlog by its length alone."""
        self._check_backlog(text_bound.fewest_tokens(num_chars, self.engine.tokenizer), "at least ")

    def _check_backlog(self, num_tokens: int, counted: str = "") -> None:
        st, limit = self.state, BACKLOG_FACTOR * self.state.retention_tokens
        if num_tokens > limit:
            raise CacheFullError(f"data of {counted}{num_tokens} tokens can never fit in session {self.id}'s backlog "
                                 f"of {limit} tokens ({BACKLOG_FACTOR} x retention_tokens): append it in parts")
        if len(st.pending) + num_tokens > limit:
            raise BacklogFullError(f"session {self.id} has {len(st.pending)} tokens of data waiting to be computed, "
                                   f"and these {counted}{num_tokens} do not fit beside them in its backlog of "
                                   f"{limit}: retry once they are computed")

    def append_tokens(self, tokens: list[int]) -> int:
        self.check_usable()
        st = self.state
        self._check_backlog(len(tokens))
        st.pending.extend(tokens)
        st.appended += len(tokens)
        st.version += 1
        st.version_ends.append((st.version, st.appended))
        self.service()
        self.check_usable()
        return st.version

    def _update_visible(self) -> None:
        st = self.state
        while st.version_ends and st.version_ends[0][1] <= st.appended - len(st.pending):
            st.visible_version = st.version_ends.popleft()[0]

    @property
    def header(self) -> list[int]:
        return self.engine.sessions.format.question_header

    def caught_up(self, version: int | None = None) -> bool:
        """Whether data `version` (default: all appended) is visible to questions and no registered
        question is being answered again."""
        target = self.state.version if version is None else version
        ready = self.ready_exit
        return self.state.visible_version >= target and not any(item.running for item in self._standing()) \
            and not (ready and ready.version < target)

    def service(self) -> None:
        """Background work, after each engine step and each append: drop old data, start the next
        ingest, ask the flash questions whose answers are stale. If it raises, this session fails
        (fail()) and nothing else does: it runs inside every engine step."""
        if self.closed or self.failure is not None:
            return
        try:
            self._service()
        except Exception as exc:  # noqa: BLE001 - whatever it was, it is this session's alone
            log.exception("session %s failed in its background work; it is stopped", self.id)
            self.fail(f"{type(exc).__name__}: {exc}")

    def _service(self) -> None:
        if self._ingest is None:
            self._start_ingest()
        for flash in self.flash.values():
            if flash.running is None and flash.version < self.state.visible_version:
                if (asked := self._ask_in_background(flash.tokens, self.flash_params)) is not None:
                    flash.running, flash.asking = asked.group, asked.version
        ready = self.ready_exit
        if ready and ready.running is None and ready.version < self.state.visible_version and self.state.ready:
            opening = self.engine.sessions.format.answer_opening
            if (asked := self._ask_in_background(opening, READY_PARAMS, after_header=False)) is not None:
                ready.running, ready.asking = asked.group, asked.version

    def question_room(self) -> int:
        """Positions a question and its answer always have, however full the data: regions 0-1
        with the header never pass retention_tokens (_start_ingest evicts to keep them within)."""
        return self.engine.max_model_len - self.state.retention_tokens

    def _check_fits(self, what: str, tokens: int, max_tokens: int) -> None:
        """A standing question (flash, ready position) must fit at any fill, or it is refused now
        rather than failing in the background later."""
        if tokens + max_tokens > self.question_room():
            raise SessionFullError(f"{what} ({tokens} tokens) and its max_tokens ({max_tokens}) need more room than "
                                   f"the session leaves when full ({self.question_room()} positions: max_model_len "
                                   f"{self.engine.max_model_len} less retention_tokens {self.state.retention_tokens})")

    def _ask_in_background(self, suffix: list[int], params: SamplingParams, after_header: bool = True):
        """A flash question or the ready position, asked by the session itself: None if the pool has
        no room now (it is asked again after the next step)."""
        try:
            return self._ask(suffix, params, Priority.FLASH, after_header=after_header)
        except CacheFullError:
            return None

    def _start_ingest(self) -> None:
        """Compute pending data and the question header after it, after making room for them."""
        st = self.state
        chunk = min(len(st.pending), INGEST_TOKENS, st.retention_tokens - st.num_frozen - 2 * self.block_size)
        if chunk <= 0 or not self._evict(len(st.tokens) + chunk + len(self.header) - st.retention_tokens):
            return
        held = self._held(with_header=False)  # the data goes where the header was
        if held is not None:
            prompt = st.tokens + st.pending[:chunk] + self.header
            self._ingest = self._request(prompt, held, SamplingParams(max_tokens=1), Priority.INGEST, prefill_only=True)

    def _ingested(self, req: Request) -> None:
        """An ingest finished: its blocks from the first one it wrote replace the session's (one
        reference each, taken before it frees)."""
        st, first = self.state, self._first_mutable()
        new = req.block_table[first:]
        self.pool.touch(new)
        self.pool.release(self.blocks[first:])
        self.blocks[first:] = new
        computed = req.num_tokens - len(st.tokens) - len(self.header)
        st.tokens.extend(st.pending[:computed])
        del st.pending[:computed]
        st.ready = True
        self._update_visible()

    def num_blocks_held(self) -> int:
        """Blocks of the session's own KV: the data and, once ready, the header after it."""
        st = self.state
        return -(-(len(st.tokens) + (len(self.header) if st.ready else 0)) // self.block_size)

    def _first_mutable(self) -> int:
        """Index of the first block the session rewrites at its next ingest: the one holding the
        end of the data (if partial) and the question header."""
        return len(self.state.tokens) // self.block_size

    def _held(self, with_header: bool = True) -> HeldContext | None:
        """The session's KV for a new request: its whole blocks of data, shared, then private
        copies of the blocks it rewrites at its next ingest (the end of the data and, if
        `with_header`, the question header after it, counted as computed). None if the pool
        has no room for the copies."""
        st, first = self.state, self._first_mutable()
        mutable = self.blocks[first:] if st.ready else []
        if len(mutable) > self.pool.num_free:
            return None
        copies = self.pool.allocate(len(mutable))  # their one reference is the held one
        self.engine.runner.copy_blocks([(a.block_id, b.block_id) for a, b in zip(mutable, copies)])
        shared = self.blocks[:first]
        self.pool.touch(shared)
        computed = first * self.block_size
        if st.ready:
            computed = len(st.tokens) + (len(self.header) if with_header else 0)
        return HeldContext(tuple(shared + copies), computed)

    def _evict(self, excess: int) -> bool:
        """Drop at least `excess` tokens of the oldest data, in whole blocks, and move the rest
        back. Blocks a running question still reads are moved into copies; False, changing
        nothing, if the pool has no room for them (the ingest waits for the readers)."""
        st, bs = self.state, self.block_size
        if excess <= 0:
            return True
        window = (len(st.tokens) - st.num_frozen) // bs
        drop = min(window, -(-(excess + int(EVICT_FRACTION * (st.retention_tokens - st.num_frozen))) // bs))
        if drop <= 0:
            return True
        first = st.num_frozen // bs
        gone, kept = self.blocks[first:first + drop], self.blocks[first + drop:]
        read = [b for b in kept if b.ref_cnt > 1]
        if len(read) > self.pool.num_free:
            return False
        copies = iter(self.pool.allocate(len(read)))
        moved = [next(copies) if b.ref_cnt > 1 else b for b in kept]
        self.engine.runner.move_blocks([(a.block_id, b.block_id) for a, b in zip(kept, moved)], -drop * bs)
        self.pool.rewritten(moved)
        self.pool.release(read + gone)
        self.blocks[first:] = moved
        del st.tokens[st.num_frozen:st.num_frozen + drop * bs]
        st.evicted += drop * bs
        return True

    # ---- questions --------------------------------------------------------------------------

    def query(self, question: str, params: SamplingParams, request_id: str | None = None) -> "Answer | Question":
        """A kept answer if `question` is registered and answered at the current data version,
        else the Question computing the answer (submitted to the engine)."""
        self.check_usable()
        if not isinstance(question, str) or not question:
            raise InvalidRequestError("question must be a non-empty string")
        if params.n != 1:
            raise InvalidRequestError("a question to a session takes n=1")
        if (fewest := text_bound.fewest_tokens(len(question), self.engine.tokenizer)) > self.engine.max_model_len:
            raise SessionFullError(f"the question ({len(question)} characters, so at least {fewest} tokens) is longer "
                                   f"than the model's whole length ({self.engine.max_model_len})")
        flash, version = self.flash.get(question), self.state.visible_version
        if flash and flash.answer is not None and flash.version == version:
            return Answer(flash.answer, flash.version, flash_hit=True)
        if self.ready_exit and (guess := self.ready_exit.answer(version)) is not None:
            return Answer(guess, version, speculative=True)
        return self._ask(self.engine.sessions.format.question(question), params, Priority.SESSION, request_id)

    def prompt(self, question: list[int]) -> list[int]:
        """The token sequence a question sees: the data (with the instructions, computed by the
        question itself until the first ingest), the header, the question."""
        st = self.state
        return st.tokens + st.pending[:max(0, st.num_frozen - len(st.tokens))] + self.header + question

    def _ask(self, suffix: list[int], params: SamplingParams, priority: Priority,
             request_id: str | None = None, after_header: bool = True) -> Question:
        """Start computing `suffix` after the data: after the question header (a question), or
        right after the data (the ready position, ready.py)."""
        prompt = self.prompt(suffix) if after_header else self.state.tokens + suffix
        room = self.engine.max_model_len - (len(prompt) - len(suffix))
        if len(suffix) + params.max_tokens > room:
            raise SessionFullError(f"the question ({len(suffix)} tokens) and its max_tokens ({params.max_tokens}) "
                                   f"need more room than the session leaves ({room} positions)")
        held = self._held(with_header=after_header)
        if held is None:
            raise CacheFullError("the KV pool is full: no room for the question; retry shortly")
        return Question(self._request(prompt, held, params, priority, request_id=request_id),
                        self.state.visible_version)

    def _request(self, prompt: list[int], held: HeldContext, params: SamplingParams, priority: Priority,
                 prefill_only: bool = False, request_id: str | None = None):
        """Start a request continuing from `held` (whose references it releases when it ends)."""
        try:
            group = self.engine.make_group({"prompt_token_ids": prompt}, params, request_id, priority=priority,
                                           held=held, prefill_only=prefill_only, owner=self, tenant=self.tenant)
            self.engine.add_group(group)
        except Exception:
            self.pool.release(held.blocks)
            raise
        return group

    def request_finished(self, req: Request) -> None:
        """Engine hook (before the request's blocks are freed)."""
        if self._ingest is not None and req is self._ingest.children[0]:
            self._ingest = None
            if req.finish_reason != "abort":
                self._ingested(req)
        self.pool.release(req.held.blocks)
        item = next((i for i in self._standing() if i.running and req is i.running.children[0]), None)
        if item is not None:
            group, item.running = item.running, None
            if req.finish_reason != "abort" and item.asking > item.version:
                item.record(group.to_output())
                if isinstance(item, Flash):
                    self._publish(item)

    def _standing(self):
        """What the session asks again after each ingest: its flash questions and ready position."""
        yield from self.flash.values()
        if self.ready_exit:
            yield self.ready_exit

    # ---- flash questions --------------------------------------------------------------------

    def register(self, question: str) -> None:
        self.check_usable()
        if not isinstance(question, str) or not question:
            raise InvalidRequestError("a flash question must be a non-empty string")
        if question not in self.flash:
            tokens = self.engine.sessions.format.question(question)
            self._check_fits("the flash question", len(tokens), self.flash_params.max_tokens)
            cost, budget = self.flash_tokens_per_append() + len(tokens) + self.flash_params.max_tokens, \
                self.engine.config.session_flash_budget
            if cost > budget:
                raise InvalidSessionError(f"with this flash question, the session's flash work would be {cost} tokens "
                                          f"per append (each question's tokens and flash_max_tokens), over this "
                                          f"server's budget of {budget} (session_flash_budget)")
            self.flash[question] = Flash(question, tokens)

    def flash_tokens_per_append(self) -> int:
        """The work its flash questions set off after each append: their tokens and their answers'."""
        return sum(len(flash.tokens) + self.flash_params.max_tokens for flash in self.flash.values())

    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call `callback(event)` (on the engine thread) with every flash answer from now on, after
        the ones already known, and `callback(None)` when the session closes; returns the function
        that unsubscribes. A closed or failed session says so instead (check_usable)."""
        self.check_usable()
        self._subscribers.append(callback)
        for flash in self.flash.values():
            if flash.answer is not None:
                callback(_event(flash))
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def _publish(self, flash: Flash) -> None:
        for callback in list(self._subscribers):
            callback(_event(flash))

    # ---- life -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background work and free the session's blocks (questions still running keep the
        blocks they read until they end)."""
        if self.closed:
            return
        self._stop()
        self.closed = True

    def fail(self, reason: str) -> None:
        """Its background work raised: stop it and free the session's memory, tell its
        subscribers, and answer SessionFailedError until its owner deletes it. Nobody else's
        work is touched: service() calls this when its own work raises."""
        if self.closed or self.failure is not None:
            return
        self.failure = reason
        for callback in list(self._subscribers):
            callback({"error": {"message": f"session {self.id} failed: {reason}", "code": SessionFailedError.code}})
        self._stop()

    def _stop(self) -> None:
        for group in [self._ingest] + [item.running for item in self._standing()]:
            if group is not None:
                try:
                    self.engine.abort_request(group.request_id)
                except Exception:  # noqa: BLE001 - stopping must finish: the request's blocks are freed anyway
                    log.exception("session %s: ending its request %s failed", self.id, group.request_id)
        self._ingest = None
        for item in self._standing():
            item.running = None
        self.pool.release(self.blocks)
        self.blocks = []
        for callback in self._subscribers:
            callback(None)  # the end of the stream
        self._subscribers.clear()

    def check_usable(self) -> None:
        """Raise SessionClosedError or SessionFailedError where the session can take no more work."""
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")
        if self.failure is not None:
            raise SessionFailedError(f"session {self.id} failed ({self.failure}); delete it and create another")

    def info(self) -> dict:
        st = self.state
        return {"id": self.id, "object": "session", "version": st.version, "visible_version": st.visible_version,
                "num_tokens": len(st.tokens), "frozen_tokens": st.num_frozen, "pending_tokens": len(st.pending),
                "evicted_tokens": st.evicted, "retention_tokens": st.retention_tokens,
                "flash": list(self.flash), "flash_tokens_per_append": self.flash_tokens_per_append(),
                "flash_budget_tokens": self.engine.config.session_flash_budget,
                "closed": self.closed, "failed": self.failure,
                "ready_exit": self.ready_exit.info() if self.ready_exit else None}


def _event(flash: Flash) -> dict:
    return {"question": flash.question, "version": flash.version, "answer": flash.answer}
