"""From an optimized span query to what the engine runs: per `g`, token ids and span intervals.

Messages are rendered one by one with the model's chat template (ChatFormat), so a message's
tokens never depend on what precedes it; a `plus` child becomes a span (padded to whole
blocks), a `cross` concatenates. An inner `g`'s output enters as the tokens it generated,
never detokenized and retokenized: `cross(x, g(x))` renders as x, the generation prompt and
the generated tokens, which is exactly the sequence the inner call left in the KV cache.
"""

from spanserve.errors import InvalidRequestError
from spanserve.pic.prompt import assemble
from spanserve.spans.ir import Cross, Fragment, Generate, Message, Node, Plus

_SENTINEL = "\x00content\x00"


class ChatFormat:
    """The chat template at the token level: a message is header(role) + text + footer(role)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parts = {role: self._header_footer(role) for role in ("system", "user", "assistant")}
        base = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}]
        without = self._render(base, False)
        self.generation_prompt = self._encode(self._render(base, True)[len(without):])
        self.bos = list(tokenizer.encode("", add_special_tokens=True))

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def _header_footer(self, role: str) -> tuple[list[int], list[int]]:
        # Rendered after a fixed system message, so templates that add a default one do not.
        first = [{"role": "system", "content": "x"}]
        base = self._render(first, False)
        full = self._render([*first, {"role": role, "content": _SENTINEL}], False)
        if not full.startswith(base) or _SENTINEL not in full:
            raise InvalidRequestError("the model's chat template cannot be rendered message by message")
        header, _, footer = full[len(base):].partition(_SENTINEL)
        return self._encode(header), self._encode(footer)

    def header(self, role: str) -> list[int]:
        return self._parts[role][0]

    def footer(self, role: str) -> list[int]:
        return self._parts[role][1]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def message(self, role: str, text: str) -> list[int]:
        """A message's tokens; control tokens typed in its text stay plain text."""
        header, footer = self._parts[role]
        return header + self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) + footer

    def output(self, token_ids: list[int]) -> list[int]:
        """An inner call's output as its caller sees it: after the generation prompt, the tokens
        as generated, then the assistant footer (its first token is usually the EOS that ended
        the generation: not repeated)."""
        footer = self._parts["assistant"][1]
        if footer and token_ids and token_ids[-1] == footer[0]:
            footer = footer[1:]
        return self.generation_prompt + list(token_ids) + footer


class QueryTokenizer:
    def __init__(self, fmt: ChatFormat, block_size: int, pad_id: int, anchor: list[int] | None = None):
        self.fmt, self.block_size, self.pad_id = fmt, block_size, pad_id
        self.anchor = anchor or []  # the engine's span anchor (pic/layout.py), if it has one

    def prompt(self, call: Generate, outputs: dict[int, list[list[int]]],
               exposed: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and spans of a `g`'s prompt; `outputs[id(g)]` holds the token ids each inner
        g already generated (n of them). An exposed call (a caller will read it as a span) starts
        with the engine's span anchor: its KV is then exactly what the caller's span needs."""
        head = self.anchor if exposed and self.anchor else self.fmt.bos
        pieces = [(head, False)]
        pieces += self._pieces(call.input, outputs)
        pieces.append((self.fmt.generation_prompt, False))
        return assemble(pieces, self.block_size, self.pad_id)

    def static_prefix(self, call: Generate, exposed: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """The start of a `g`'s prompt that no inner call's output changes, in whole blocks, with
        its spans: it can be prefilled while the inner calls run. Empty if the input has no
        inner call or starts with one."""
        items = call.input.items if isinstance(call.input, Cross) else (call.input,)
        pieces = [(self.anchor if exposed and self.anchor else self.fmt.bos, False)]
        for item in items:
            if _has_call(item):
                if isinstance(item, Plus):  # its spans start on a block boundary: pad up to it
                    pieces.append(([], True))
                ids, spans = assemble(pieces, self.block_size, self.pad_id)
                whole = len(ids) - len(ids) % self.block_size
                return ids[:whole], [(a, b) for a, b in spans if a < b <= whole]
            pieces += self._pieces(item, {})
        return [], []

    def exposed(self, call: Generate, outputs) -> list[list[int]]:
        """The sequences that hold, after the anchor, what a caller's span reads for each output
        of `call` under plus distribution (the call's input, the generation prompt, the output),
        padded to whole blocks. Empty if the call's own prompt is not a prefix of them (it has
        spans, or a BOS and no anchor): then there is no reuse to prepare."""
        ids, spans = self.prompt(call, outputs, exposed=True)
        if spans or (self.fmt.bos and not self.anchor):
            return []
        out = []
        for seq in self._spans(Cross((call.input, call)), outputs):
            out.append(self.anchor + seq + [self.pad_id] * (-len(seq) % self.block_size))
        return out

    def static_spans(self, node: Node) -> list[list[int]]:
        """The tokens of every span in a query that no call's output changes (a plus child with no
        g inside), each as a prompt holds it, padded to whole blocks: what can be looked up in a
        cache before anything runs (a cluster's router does)."""
        found = []
        for child in node.children:
            if isinstance(node, Plus) and not _has_call(child):  # a span: nothing inside it is one
                tokens = self._flat(child, {})
                found.append(tokens + [self.pad_id] * (-len(tokens) % self.block_size))
            else:
                found += self.static_spans(child)
        return found

    def _pieces(self, node: Node, outputs) -> list[tuple[list[int], bool]]:
        """(token ids, is_span) in order: a plus child is a span (one per output of an n > 1
        call), everything else runs on in context."""
        if isinstance(node, Plus):
            return [(tokens, True) for child in node.items for tokens in self._spans(child, outputs)]
        if isinstance(node, Cross):
            return [piece for child in node.items for piece in self._pieces(child, outputs)]
        return [(self._flat(node, outputs), False)]

    def _spans(self, node: Node, outputs) -> list[list[int]]:
        if isinstance(node, Generate):
            return [self.fmt.output(ids) for ids in outputs[id(node)]]
        if isinstance(node, Cross) and len(node.items) == 2 and isinstance(node.items[1], Generate):
            head = self._flat(node.items[0], outputs)  # cross(x, g(x)): x before each output
            return [head + tail for tail in self._spans(node.items[1], outputs)]
        return [self._flat(node, outputs)]

    def _flat(self, node: Node, outputs) -> list[int]:
        """All of a node's tokens in order (inside a span nothing is independent any more)."""
        if isinstance(node, Message):
            return self.fmt.message(node.role, node.text)
        if isinstance(node, Fragment):
            return self.fmt.message("user", node.text)
        if isinstance(node, Generate):
            return [t for ids in outputs[id(node)] for t in self.fmt.output(ids)]
        if isinstance(node, (Cross, Plus)):
            return [t for child in node.items for t in self._flat(child, outputs)]
        raise InvalidRequestError(f"cannot tokenize a {type(node).__name__} node (optimize the query first)")


def _has_call(node: Node) -> bool:
    return isinstance(node, Generate) or any(_has_call(child) for child in node.children)
