"""Prompts made of parts: ordinary text and position-independent spans.

    llm.generate([system, Span(doc2), Span(doc1), question], params)

Each part is tokenized on its own. A span must start on a KV block boundary and its last
block should be full, so the text before a span and the span itself are padded with a pad
token: then every block of the span is shared, whatever comes before or after it.
"""

from dataclasses import dataclass, field, replace

from spanserve.errors import InvalidRequestError, InvalidSpanError

_MARK = "\x00part{}\x00"  # stands in for a message's text or span while a chat template renders


@dataclass(frozen=True)
class Span:
    """Text whose KV is computed on its own, so a cached copy is reused at any position."""

    text: str
    in_message: bool = field(default=False, compare=False)  # set by chat_parts: special tokens stay plain

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text:
            raise InvalidSpanError("a Span holds non-empty text")


@dataclass(frozen=True)
class MessageText:
    """Text of a chat message: special tokens typed in it stay plain text, as in OpenAI-compatible
    servers, so a user cannot open a system turn by writing its control token."""

    text: str


def is_parts_prompt(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and any(isinstance(p, Span) for p in prompt)


def tokenize_parts(tokenizer, parts, block_size: int, pad_id: int, add_special_tokens: bool = True,
                   span_tokens=None) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and [start, end) spans of a list of str / Span parts. Special tokens (a BOS
    for models that want one) are left out for text a chat template rendered. `span_tokens`
    (span_tokens.py, or anything with its `encode`) tokenizes the spans, remembering them."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise InvalidRequestError("a prompt of parts is a non-empty list of strings and Spans")
    pieces = [(list(tokenizer.encode("", add_special_tokens=True)) if add_special_tokens else [], False)]
    for part in parts:
        if isinstance(part, MessageText):
            pieces.append((tokenizer.encode(part.text, add_special_tokens=False, split_special_tokens=True), False))
            continue
        if not isinstance(part, (str, Span)):
            raise InvalidRequestError(f"a prompt part is a str or a Span, got {type(part).__name__}")
        text = part.text if isinstance(part, Span) else part
        # a span of a chat message is message text too; in a plain prompt it is tokenized as the text around it
        plain = isinstance(part, Span) and part.in_message
        if isinstance(part, Span) and span_tokens is not None:
            pieces.append((span_tokens.encode(text, split_special_tokens=plain), True))
        else:
            pieces.append((tokenizer.encode(text, add_special_tokens=False, split_special_tokens=plain),
                           isinstance(part, Span)))
    return assemble(pieces, block_size, pad_id)


def assemble(pieces, block_size: int, pad_id: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Concatenate (token ids, is_span) pieces; pad so each span starts on a block boundary and
    fills whole blocks. Returns the ids and the spans' [start, end) intervals."""
    ids, spans = [], []
    for tokens, is_span in pieces:
        if is_span:
            _pad(ids, block_size, pad_id)
            start = len(ids)
            ids.extend(tokens)
            _pad(ids, block_size, pad_id)
            spans.append((start, len(ids)))
        else:
            ids.extend(tokens)
    return ids, spans


def _pad(ids: list[int], block_size: int, pad_id: int) -> None:
    ids.extend([pad_id] * (-len(ids) % block_size))


def chat_parts(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list:
    """Render a conversation whose message contents may contain spans into str (the template's
    own text), MessageText and Span parts.

    A content is a string or a list of parts: strings, Spans, or OpenAI-style
    {"type": "text", "text": ..., "span": true} dicts. The chat template renders the
    conversation with a marker in place of each piece of content; the text is then cut at the
    markers. (A template that transforms contents, e.g. trims them, transforms the markers instead.)
    `tools`: OpenAI's tool list, for a template that renders tools (spanserve/tools/).
    """
    pieces: list = []
    rendered = [{**m, "content": _content_with_marks(m.get("content"), pieces)} for m in messages]
    with_tools = {"tools": tools} if tools else {}  # (a template without tools is not asked about them)
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **with_tools)
    parts: list = []
    for k, piece in enumerate(pieces):
        before, found, text = text.partition(_MARK.format(k))
        if not found:  # the template dropped this content: so do we
            text = before
            continue
        parts += [before, piece] if before else [piece]
    return parts + [text] if text else parts


def _content_with_marks(content, pieces: list) -> str:
    if isinstance(content, str):
        content = [content]
    if not isinstance(content, list):
        raise InvalidRequestError("a message content is a string or a list of parts")
    out = []
    for part in content:
        if isinstance(part, dict):
            if part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("a content part is {'type': 'text', 'text': str, 'span': bool}")
            part = Span(part["text"]) if part.get("span") else part["text"]
        if isinstance(part, Span):
            piece = replace(part, in_message=True)
        elif isinstance(part, str):
            if not part:
                continue
            piece = MessageText(part)
        else:
            raise InvalidRequestError(f"a content part is a str, a Span or a dict, got {type(part).__name__}")
        out.append(_MARK.format(len(pieces)))
        pieces.append(piece)
    return "".join(out)
