"""A reply streamed as OpenAI streams it: its text as content deltas, its calls as tool_calls
deltas (the first of a call with its id and name, the next ones with pieces of its arguments).

Text before a call is content as it comes (held to the end where it starts as JSON: it may be
calls written bare). Where a grammar holds the answer to calls (tool_choice
required or a named function) each call's arguments stream as they are generated; under auto a
call may turn out not to parse, so the calls are sent when the answer ends, once read as the
non-streamed reply reads them."""

import json

from spanserve.tools import hermes
from spanserve.tools.spec import Tools, new_call_id


class ToolStream:
    """The deltas of one choice: feed it the choice's text so far, then its end."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.content_sent = 0  # characters of text sent as content
        self.calls: list[dict] = []  # per call started: {"id", "sent": arguments characters sent}
        self.in_calls = False

    def feed(self, text: str) -> list[dict]:
        """The deltas (each a chat delta dict) that `text`, the choice's text so far, adds."""
        if self.tools.choice == "none":
            return self._content(text, len(text))
        deltas = []
        if not self.in_calls:
            start = text.find(hermes.OPEN)
            self.in_calls = start >= 0
            if self.in_calls or not (self.content_sent == 0 and hermes.may_be_bare(text)):
                deltas += self._content(text, start if self.in_calls else _safe_end(text))
        if self.in_calls and self.tools.constrained:
            deltas += self._constrained_calls(text)
        return deltas

    def end(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas, once the choice has ended, and its finish reason."""
        if not self.in_calls and self.tools.choice != "none":
            self.in_calls = hermes.OPEN in text
        reply = self.tools.reply(text, finish_reason, [c["id"] for c in self.calls])
        if not reply.tool_calls:  # text after all: what is not yet sent goes as content
            return self._content(text, len(text)) if not self.calls else [], reply.finish_reason
        deltas = []
        for k, call in enumerate(reply.tool_calls):
            if k >= len(self.calls):
                deltas.append(_call_start(k, call.id, call.name))
                self.calls.append({"id": call.id, "sent": 0})
            rest = call.arguments[self.calls[k]["sent"]:]
            if rest:
                deltas.append(_arguments(k, rest))
        return deltas, reply.finish_reason

    def _content(self, text: str, end: int) -> list[dict]:
        if end <= self.content_sent:
            return []
        piece, self.content_sent = text[self.content_sent:end], end
        return [{"content": piece}]

    def _constrained_calls(self, text: str) -> list[dict]:
        """Deltas of the calls written so far: a call's start once its name is known, then its
        arguments up to the last "}" seen (what follows may be the call's own closing brace)."""
        deltas, blocks = [], text.split(hermes.OPEN)[1:]
        for k, block in enumerate(blocks):
            body = block.split(hermes.CLOSE)[0]
            head = hermes.HEAD.match(body)
            if head is None:
                break
            if k == len(self.calls):
                call_id = new_call_id()
                self.calls.append({"id": call_id, "sent": 0})
                deltas.append(_call_start(k, call_id, _unquoted(head.group(1))))
            arguments = body[head.end():body.rfind("}")] if "}" in body[head.end():] else ""
            if len(arguments) > self.calls[k]["sent"]:
                deltas.append(_arguments(k, arguments[self.calls[k]["sent"]:]))
                self.calls[k]["sent"] = len(arguments)
        return deltas


def _safe_end(text: str) -> int:
    """How much of `text` is surely content: all but a tail that may be the start of a call."""
    for keep in range(min(len(hermes.OPEN) - 1, len(text)), 0, -1):
        if hermes.OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def _unquoted(name: str) -> str:
    return json.loads(f'"{name}"')


def _call_start(index: int, call_id: str, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def _arguments(index: int, piece: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
