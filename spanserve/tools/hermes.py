"""The Hermes tool-call markup, which Qwen2.5's chat template teaches its model (and which
spanserve teaches, in its system prompt, a model whose template has no tools):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, a newline between blocks."""

import json
import re

from spanserve.structured.schema import closed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
# a call's head, up to where its arguments start (a model writes the name first, as it was taught)
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# the JSON the grammar holds a call to: the separators the template writes
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar(functions: list, parallel: bool, markers_are_tokens: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or several if `parallel`, each of a
    function among `functions` with arguments valid against its parameters' schema.
    `markers_are_tokens`: the tokenizer has <tool_call> and </tool_call> as tokens of their own,
    which the grammar then names as tokens (llguidance does not spell added tokens as text)."""
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f.name}, "arguments": closed(f.parameters)}}
                        for f in functions],
              "x-guidance": _LAYOUT}
    open_, close = (OPEN, CLOSE) if markers_are_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: {open_} "\\n" body "\\n" {close}\n'
            f"body: %json {json.dumps(schema)}\n")


def split(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    """A reply's text before its first call, and each call's (name, arguments as JSON text);
    None if a block is not a call (its JSON broken, its name or arguments missing). A reply
    with no block that is nothing but calls' JSON (bare, in a ``` fence, or a list of them),
    as small models write them, is read as those calls."""
    start = text.find(OPEN)
    if start < 0:
        bare = _bare_calls(text)
        return ("", bare) if bare else (text, [])
    calls = []
    for block in _BLOCK.finditer(text, start):
        call = parse_call(block.group(1))
        if call is None:
            return None
        calls.append(call)
    return text[:start], calls


def may_be_bare(text: str) -> bool:
    """`text` so far may turn out to be bare calls (it starts as JSON or a fence)."""
    return text.lstrip()[:1] in ("", "{", "[", "`")


def _bare_calls(text: str) -> list[tuple[str, str]]:
    text = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    text = fence.group(1) if fence else text
    values, decoder, pos = [], json.JSONDecoder(), 0
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        values += value if isinstance(value, list) else [value]
        pos = len(text) - len(text[pos:].lstrip())
    calls = [_call_of(v) for v in values]
    return calls if calls and all(calls) else []


def _call_of(obj) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as the model wrote them) of one block's JSON, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    call = _call_of(obj)
    if call is None:
        return None
    head = HEAD.match(body)
    if head is not None:  # as the model wrote them, when they are the last member
        written = body[head.end():body.rstrip().rindex("}")].rstrip()
        if _loads(written) == obj["arguments"]:
            return obj["name"], written
    return call


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def render(name: str, arguments: dict) -> str:
    """One call as the model writes it (for a conversation's past calls, where the template has no tools)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def instructions(tools: list[dict]) -> str:
    """What a system prompt says to a model whose chat template has no tools: the functions, and
    how to call them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call the functions listed between <tools> and </tools>, one or more "
            f"times, to answer the user:\n<tools>\n{listed}\n</tools>\n\nTo call a function, write a JSON "
            "object with its name and arguments between <tool_call> and </tool_call>, and nothing else:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
