"""Routing keys: the KV block hashes a request will look up, computed from its body without the model.

The ingress hashes a prompt as the engine does (kv/hashing.py, pic/layout.py), so that the router
can count how many of them each replica holds. Two kinds are reproduced exactly:
- the context chain of the blocks before the prompt's first span (a system prompt, a chat's
  history): their keys carry no span geometry;
- each span's span-local chain (a document, wherever it stands): PromptLayout.local_hashes under
  the engine's default link policy.
A span query's keys are its static spans' (spans/tokenize.py, static_spans): the documents it
reads, whatever call reads them. Blocks after the first span chain through span geometry and
link-policy signatures: left out. A request naming its own link policy may get span keys no
replica has (it is then routed by load), and so may a chat with tools. A key is a hash's first
KEY_CHARS hex digits: enough to tell blocks apart for a score, a quarter of the bytes to publish.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

from spanserve.kv.hashing import ROOT_HASH, BlockHash, extend_block_hashes, hash_chain
from spanserve.pic.prompt import chat_parts, tokenize_parts
from spanserve.pic.span_tokens import SpanTokens
from spanserve.sampling import SamplingParams
from spanserve.server import openai_format as fmt
from spanserve.server.protocol import ChatCompletionRequest, CompletionRequest, SpanQueryRequest
from spanserve.spans.ir import parse
from spanserve.spans.tokenize import ChatFormat, QueryTokenizer
from spanserve.tools.conversation import for_template

KEY_CHARS = 16
PROBE = "Routing probe: naïve café, 12,345.67 tokens\n\tend."  # text two different tokenizers split apart


def key(block_hash: BlockHash) -> str:
    return block_hash.hex()[:KEY_CHARS]


@dataclass(frozen=True)
class HashContext:
    """What an engine's block hashes depend on besides the tokens and the cache salt."""

    block_size: int
    pad_id: int  # spans are padded to whole blocks with it (pic/prompt.py)
    anchor_hash: BlockHash | None  # the parent of a span's chain when it does not start the prompt
    span_key: tuple  # the default link policy's part of a span's first key
    uses_spans: bool  # False under link policy full: the whole prompt is one context chain
    probe_ids: tuple[int, ...] = ()  # the engine's tokens of PROBE: the ingress's tokenizer must agree

    @classmethod
    def of(cls, engine) -> "HashContext":
        link = engine.link_policy(SamplingParams())
        anchor = engine.anchor.last_hash if engine.anchor is not None else None
        return cls(engine.config.block_size, engine.pad_token_id, anchor, link.span_key, link.uses_spans,
                   tuple(engine.tokenizer.encode(PROBE, add_special_tokens=False)))

    def check(self, tokenizer) -> None:
        """Refuse a tokenizer that is not the engine's: its keys would miss, and the span ids the
        ingress hands the replicas would be wrong."""
        if tuple(tokenizer.encode(PROBE, add_special_tokens=False)) != self.probe_ids:
            raise ValueError("the ingress's tokenizer does not tokenize as the replicas' engine does")


def prompt_keys(ids: list[int], spans: list[tuple[int, int]], salt: str | None, ctx: HashContext) -> list[str]:
    """Keys of a token prompt with [start, end) spans, as the engine would hash it."""
    spans = sorted(tuple(s) for s in spans) if ctx.uses_spans else []
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, ids[:spans[0][0] if spans else len(ids)], ctx.block_size, salt)
    keys = [key(h) for h in hashes]
    for start, end in spans:
        end = min(end, len(ids) - 1)  # the engine cuts a span before the prompt's last token
        keys += span_keys(ids[start:end // ctx.block_size * ctx.block_size], salt, ctx, starts_prompt=start == 0)
    return keys


def span_keys(tokens: list[int], salt: str | None, ctx: HashContext, starts_prompt: bool = False) -> list[str]:
    """Keys of a span's whole blocks: its span-local chain, the same wherever it stands (after
    the engine's anchor, unless it starts the prompt)."""
    bs, first_key = ctx.block_size, ((salt,) if salt else ()) + ctx.span_key
    parent = ctx.anchor_hash if not starts_prompt and ctx.anchor_hash is not None else ROOT_HASH
    return [key(h) for h in hash_chain(parent, tokens[:len(tokens) // bs * bs], bs, lambda j: () if j else first_key)]


class _Recorded:
    """The ingress's span memo for one request, noting the ids of each span it tokenizes: the
    replica is handed them (replica.py), so it does not tokenize a new document again."""

    def __init__(self, span_tokens: SpanTokens):
        self.span_tokens, self.entries = span_tokens, []

    def encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        ids = self.span_tokens.encode(text, split_special_tokens=split_special_tokens)
        self.entries.append((text, split_special_tokens, ids))
        return ids


@dataclass
class Routing:
    """What the ingress computed of a request: its keys, and the token ids of its spans."""

    keys: list[str] = field(default_factory=list)
    span_tokens: list[tuple[str, bool, list[int]]] = field(default_factory=list)


class RequestKeys:
    """Keys of the prompt(s) of a completions or chat request body, and the ids of its spans;
    nothing for anything else, or for a body the replica will refuse (it answers that; routing
    is only advice)."""

    def __init__(self, tokenizer, ctx: HashContext):
        self.tokenizer, self.ctx = tokenizer, ctx
        # every text of a request, remembered: documents, instructions and system prompts come again
        self.span_tokens = SpanTokens(tokenizer)
        self._query_tokenizer: QueryTokenizer | None = None  # for span queries, made at the first

    def __call__(self, path: str, body: bytes, salt_of) -> Routing:
        """`salt_of(client_salt)`: the engine's cache salt of this request (its tenant's and the
        client's). A span query (/v1/spans) routes as a whole, by the spans it holds from the
        start (its documents), not those its calls will generate."""
        spans_seen = _Recorded(self.span_tokens)
        try:
            if path == "/v1/completions":
                req = CompletionRequest.model_validate_json(body)
                engine = SimpleNamespace(tokenize=lambda prompt: self._tokenize(prompt, spans_seen))
                prompts = [p for _, p in fmt.completion_prompts(req.prompt, req.spans, engine)]
            elif path == "/v1/spans":
                req = SpanQueryRequest.model_validate_json(body)
                spans = self._queries().static_spans(parse(req.query)) if self.ctx.uses_spans else []
                salt = salt_of(req.cache_salt)
                return Routing(list(dict.fromkeys(k for tokens in spans for k in span_keys(tokens, salt, self.ctx))))
            elif path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate_json(body)
                messages, shown = for_template(req.chat_messages(), req.tools_of(), self.tokenizer.chat_template)
                ids, spans = self._parts(chat_parts(self.tokenizer, messages, shown), spans_seen,
                                         add_special_tokens=False)
                prompts = [{"prompt_token_ids": ids, "spans": spans}]
            else:
                return Routing()
        except Exception:  # noqa: BLE001 - an invalid body: the replica's 400 says why
            return Routing()
        salt = salt_of(req.cache_salt)
        keys = []
        for prompt in prompts:
            keys += prompt_keys(prompt["prompt_token_ids"], prompt.get("spans") or [], salt, self.ctx)
        return Routing(list(dict.fromkeys(keys)), spans_seen.entries)

    def _queries(self) -> QueryTokenizer:
        if self._query_tokenizer is None:
            self._query_tokenizer = QueryTokenizer(ChatFormat(self.tokenizer), self.ctx.block_size, self.ctx.pad_id)
        return self._query_tokenizer

    def _tokenize(self, prompt, spans_seen: _Recorded):
        """The engine's tokenize, for the prompt forms openai_format.completion_prompts hands it."""
        if isinstance(prompt, str):
            return SimpleNamespace(token_ids=self.span_tokens.encode(prompt, add_special_tokens=True), spans=[])
        ids, spans = self._parts(prompt, spans_seen)
        return SimpleNamespace(token_ids=ids, spans=spans)

    def _parts(self, parts, spans_seen: _Recorded, add_special_tokens: bool = True):
        return tokenize_parts(self.span_tokens, parts, self.ctx.block_size, self.ctx.pad_id, add_special_tokens,
                              spans_seen)
