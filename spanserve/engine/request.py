"""Request: one sequence being generated, and everything the engine tracks about it."""

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spanserve.kv.block_pool import Block
from spanserve.pic.layout import PromptLayout
from spanserve.sampling import SamplingParams
from spanserve.sparse.decode import SparseDecode
from spanserve.structured.grammars import Constraint


class Priority(enum.IntEnum):
    """Scheduling classes, most urgent first; FIFO within a class."""

    FLASH = 0  # a session's registered question, re-answered after new data
    SESSION = 1  # a question to a session
    STATELESS = 2  # an ordinary request
    INGEST = 3  # data appended to a session, computed in the background


@dataclass(frozen=True)
class HeldContext:
    """Computed KV a request continues from that someone else owns (a session's data): whole
    blocks, referenced by this object from creation until its owner releases them. Such KV is
    never shared through the prefix cache: its owner may move it (sessions/session.py)."""

    blocks: tuple[Block, ...]
    num_tokens: int  # tokens of `blocks` whose KV is computed (from the first block on)


class RequestOwner(Protocol):
    def request_finished(self, req: "Request") -> None:
        """Called once a request ends (finished or aborted), before its blocks are freed."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    max_total_tokens: int = 1 << 30  # prompt + output may not exceed the model's max length
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str = ""  # the user's request id; children of an n > 1 request share it
    index: int = 0  # position among those children
    # A sibling (same prompt, n > 1) whose prefill this request waits for, to share its blocks.
    wait_for: "Request | None" = None
    layout: PromptLayout | None = None  # position-independent spans of the prompt, if any
    priority: Priority = Priority.STATELESS
    tenant: str | None = None  # whose work it is: steps are shared among tenants (scheduler.py)
    held: HeldContext | None = None  # KV it starts from, owned elsewhere
    prefill_only: bool = False  # done once its prompt is computed: nothing sampled (an ingest)
    owner: RequestOwner | None = None  # told when it ends
    sparse: "SparseDecode | None" = None  # its sparse decode flow and state, if any
    constraint: "Constraint | None" = None  # its place in its grammar (structured outputs), if any

    def __post_init__(self):
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.layout = self.layout or PromptLayout(self.num_prompt_tokens)
        # In-context progress: every token before this index has its KV in `block_table`.
        self.num_computed_tokens = 0
        self.block_table: list[Block] = []  # the context view (pic/layout.py)
        self.block_hashes: list[bytes] = []  # context-chain hash of each full block
        self.local_hashes: dict[int, bytes] | None = None  # span-local hashes of span blocks
        self.num_hashed_blocks = 0
        # Spans: their own progress, published blocks, and the span-local twins of blocks
        # that the link policy recomputes in context (block index -> block).
        self.span_done: list[int] = [s.start for s in self.layout.spans]
        self.span_hashed: list[int] = [0] * len(self.layout.spans)
        self.span_cached_until: list[int] = list(self.span_done)  # progress found in the cache
        self.shadows: dict[int, Block] = {}
        self.spare_blocks: list[Block] = []  # held for the private copies a focus probe's relink makes
        self.anchor_blocks: list[Block] = []  # the engine's pinned anchor (pic/layout.py), if any
        self.num_cached_tokens: int | None = None  # prefix hits at first admission
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict] = []
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.generator: torch.Generator | None = None
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def span_table(self, s: int) -> list[Block]:
        """The blocks span s's own sub-sequence reads and writes: the anchor's, if it has one,
        then its own from its first token on."""
        span, bs = self.layout.spans[s], self.layout.block_size
        own = [self.shadows.get(i) or self.block_table[i] for i in range(span.start // bs, -(-span.sub_end // bs))]
        return (self.anchor_blocks if span.offset else []) + own

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.finish_time = time.monotonic()
