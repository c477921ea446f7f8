"""The trace `spanserve bench cluster` replays: RAG requests over Zipf-popular documents, k per
request in a random order, from several tenants, mixed with multi-turn chats.

One list of calls (make_trace) is rendered two ways: as HTTP bodies for real replicas (http_body,
real prose documents) and as token ids with the engine's block keys for the simulation
(SimRequests, synthetic ids: keys and lengths are all the simulation reads).

Every tenant sends the same instruction and draws from the same documents (a shared corpus), but
tenants never share KV (their cache salts differ): a router that matches text alone sends one
tenant where another's blocks are.
"""

import random
from dataclasses import dataclass, field

from spanserve.cluster.keys import HashContext, prompt_keys

INSTRUCTION = "Answer the question from the documents above.\n"


@dataclass(frozen=True)
class Call:
    tenant: int
    docs: tuple[int, ...] = ()  # a RAG request: its documents, in prompt order
    conversation: int | None = None  # a chat turn: its conversation (per tenant) and turn
    turn: int = 0
    question: int = 0  # which question (distinct per call)


def make_trace(calls: int, docs: int, k: int, tenants: int, conversations: int = 0, turns: int = 4,
               chat_share: float = 0.0, zipf_s: float = 1.0, seed: int = 0) -> list[Call]:
    """`calls` calls: with probability `chat_share` the next turn of one of a tenant's
    `conversations` (each up to `turns` turns), else k distinct documents drawn with Zipf(s)
    popularity, shuffled."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** zipf_s for rank in range(docs)]
    popular = list(range(docs))
    rng.shuffle(popular)  # popularity rank -> document
    next_turn = {(t, c): 0 for t in range(tenants) for c in range(conversations)}
    trace = []
    for i in range(calls):
        tenant = rng.randrange(tenants)
        open_chats = [c for c in range(conversations) if next_turn[(tenant, c)] < turns]
        if open_chats and rng.random() < chat_share:
            chat = rng.choice(open_chats)
            trace.append(Call(tenant, conversation=chat, turn=next_turn[(tenant, chat)], question=i))
            next_turn[(tenant, chat)] += 1
            continue
        chosen: list[int] = []
        while len(chosen) < k:
            doc = popular[rng.choices(range(docs), weights)[0]]
            if doc not in chosen:
                chosen.append(doc)
        trace.append(Call(tenant, docs=tuple(chosen), question=i))
    return trace


def http_body(call: Call, documents: list[str], model: str, max_tokens: int = 1) -> tuple[str, dict]:
    """(path, JSON body) of a call for a real server."""
    if call.conversation is None:
        parts = [INSTRUCTION.replace(" above", " below"), *({"text": documents[d], "span": True} for d in call.docs),
                 f"Question {call.question}: what do these documents say about the nation's finances?\n"]
        return "/v1/completions", {"model": model, "prompt": parts, "max_tokens": max_tokens, "temperature": 0}
    messages = [{"role": "system", "content": f"You are a careful assistant for tenant {call.tenant}."}]
    for turn in range(call.turn):
        messages += [{"role": "user", "content": _chat_line(call, turn)},
                     {"role": "assistant", "content": f"Noted item {turn} of conversation {call.conversation}."}]
    messages.append({"role": "user", "content": _chat_line(call, call.turn)})
    return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def _chat_line(call: Call, turn: int) -> str:
    return (f"Conversation {call.conversation}, turn {turn}: please keep track of item {turn} "
            f"for tenant {call.tenant} and say when you have it.")


@dataclass
class SimRequest:
    """A call as the simulation sees it."""

    text: str  # one character per token: what a text-prefix router matches
    chains: list[list[str]]  # block keys, per chain, in lookup order (the context chain, then each span's)
    prompt_tokens: int
    block_size: int
    all_keys: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.all_keys = [key for chain in self.chains for key in chain]


class SimRenderer:
    """Token ids and engine block keys of calls; documents of `doc_tokens` tokens."""

    def __init__(self, doc_tokens: int = 512, system_tokens: int = 32, question_tokens: int = 16,
                 turn_tokens: int = 24, block_size: int = 16):
        self.doc_tokens, self.system_tokens, self.question_tokens = doc_tokens, system_tokens, question_tokens
        self.turn_tokens, self.bs = turn_tokens, block_size
        self.ctx = HashContext(block_size=block_size, pad_id=0, anchor_hash=None, span_key=(), uses_spans=True)
        self._span_keys: dict[tuple[int, int], list[str]] = {}

    def request(self, call: Call) -> SimRequest:
        salt = f"tenant-{call.tenant}"
        system = [100 + j for j in range(self.system_tokens)]
        if call.conversation is None:
            question = _ids(("q", call.question), self.question_tokens)
            ids = system + [t for d in call.docs for t in _ids(("doc", d), self.doc_tokens)] + question
            chains = [prompt_keys(system, [], salt, self.ctx)] + [self._doc_keys(call.tenant, d) for d in call.docs]
        else:
            ids = list(system)
            for turn in range(call.turn + 1):
                ids += _ids(("chat", call.tenant, call.conversation, turn), self.turn_tokens)
                if turn < call.turn:
                    ids += _ids(("reply", call.tenant, call.conversation, turn), self.turn_tokens)
            chains = [prompt_keys(ids, [], salt, self.ctx)]
        return SimRequest("".join(chr(0x3400 + t % 20000) for t in ids), chains, len(ids), self.bs)

    def _doc_keys(self, tenant: int, doc: int) -> list[str]:
        """A document's span chain: the same wherever it stands (the engine's span-local hashes)."""
        if (tenant, doc) not in self._span_keys:
            ids = _ids(("doc", doc), self.doc_tokens) + [0]  # the engine cuts a span before the last token
            self._span_keys[(tenant, doc)] = prompt_keys(ids, [(0, self.doc_tokens)], f"tenant-{tenant}", self.ctx)
        return self._span_keys[(tenant, doc)]


def _ids(what: tuple, n: int) -> list[int]:
    rng = random.Random(repr(what))
    return [rng.randrange(1000, 30000) for _ in range(n)]
