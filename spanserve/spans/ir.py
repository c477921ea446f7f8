"""Span queries: expression trees of inference calls (IBM's span query IR).

Leaves are chat messages (`system`, `user`, `assistant`) and corpus `fragment`s. `g` generates
from its input tree; its output is an assistant message usable as input elsewhere. `cross`
joins children in order (each attends to everything before it); `plus` joins children that
commute (each becomes a position-independent span, computed once and reused anywhere).
`chat` and `retrieve` are sugar the optimizer removes.

Wire form: JSON with one key per node, e.g.
    {"g": {"input": {"cross": [{"system": "..."}, {"plus": [{"user": "doc A"}, {"user": "doc B"}]},
                               {"user": "question"}]}, "max_tokens": 64}}
"""

from dataclasses import dataclass, field, fields, replace

from spanserve.errors import InvalidRequestError
from spanserve.structured.params import InvalidGrammarError, StructuredOutputs, from_response_format


class Node:
    """Base of every node. Nodes are immutable; rewrites build new trees."""

    @property
    def children(self) -> tuple["Node", ...]:
        return ()

    def with_children(self, children: tuple["Node", ...]) -> "Node":
        return self


@dataclass(frozen=True)
class Message(Node):
    role: str  # system | user | assistant
    text: str


@dataclass(frozen=True)
class Fragment(Node):
    """A piece of a corpus (a retrieved passage); shown to the model as a user message."""

    text: str
    source: str = ""


@dataclass(frozen=True)
class Join(Node):
    items: tuple[Node, ...]

    @property
    def children(self) -> tuple[Node, ...]:
        return self.items

    def with_children(self, children):
        return replace(self, items=tuple(children))


class Plus(Join):
    """Children commute: each is an independent span."""


class Cross(Join):
    """Children in order: each attends to everything before it."""


@dataclass(frozen=True)
class Generate(Node):
    input: Node
    max_tokens: int = 64
    temperature: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    bare: bool = False  # a caller sees only the output, not the input that produced it
    # OpenAI's response_format: a judge's verdict as JSON its caller can parse
    response_format: dict | None = field(default=None, hash=False, compare=True)

    def structured(self) -> StructuredOutputs | None:
        """The constraint on its output, if any."""
        return from_response_format(self.response_format) if self.response_format is not None else None

    @property
    def children(self) -> tuple[Node, ...]:
        return (self.input,)

    def with_children(self, children):
        return replace(self, input=children[0])


@dataclass(frozen=True)
class Chat(Node):
    """Sugar: a chat call over messages in order, i.e. g(cross(messages))."""

    messages: tuple[Node, ...]
    params: dict = field(default_factory=dict, hash=False, compare=True)

    @property
    def children(self) -> tuple[Node, ...]:
        return self.messages

    def with_children(self, children):
        return replace(self, messages=tuple(children))


@dataclass(frozen=True)
class Retrieve(Node):
    """Sugar: the `k` corpus fragments nearest to `query`, i.e. plus(fragment, ...)."""

    query: str
    corpus: str | None = None  # an index directory (spanserve index DIR); None: the default
    k: int = 4


# ---- builder ---------------------------------------------------------------------------------


def system(text: str) -> Message:
    return Message("system", text)


def user(text: str) -> Message:
    return Message("user", text)


def assistant(text: str) -> Message:
    return Message("assistant", text)


def fragment(text: str, source: str = "") -> Fragment:
    return Fragment(text, source)


def plus(*children: Node) -> Plus:
    return Plus(tuple(children))


def cross(*children: Node) -> Cross:
    return Cross(tuple(children))


def g(input: Node, max_tokens: int = 64, temperature: float = 0.0, n: int = 1,  # noqa: A002
      seed: int | None = None, stop: tuple[str, ...] | list[str] = (), bare: bool = False,
      response_format: dict | None = None) -> Generate:
    if response_format is not None and not _response_format(response_format):
        raise QueryError("g", f"bad response_format {response_format!r}")
    return Generate(input, max_tokens, temperature, n, seed, tuple(stop), bare, response_format)


def chat(*messages: Node, **params) -> Chat:
    return Chat(tuple(messages), params)


def retrieve(query: str, corpus: str | None = None, k: int = 4) -> Retrieve:
    return Retrieve(query, corpus, k)


def generate_nodes(node: Node):
    """Every g in the tree, the root's included."""
    if isinstance(node, Generate):
        yield node
    for child in node.children:
        yield from generate_nodes(child)


# ---- wire form -------------------------------------------------------------------------------

_GENERATE_FIELDS = {f.name: f for f in fields(Generate) if f.name != "input"}


def parse(data, path: str = "$") -> Node:
    """A node from its JSON form; errors name the path to the bad node ($.g.input.cross[1])."""
    if not isinstance(data, dict) or len(data) != 1:
        raise QueryError(path, "a node is an object with exactly one key: its type "
                               "(system, user, assistant, fragment, g, plus, cross, chat, retrieve)")
    (kind, body), = data.items()
    here = f"{path}.{kind}"
    if kind in ("system", "user", "assistant"):
        return Message(kind, _text(body, here))
    if kind == "fragment":
        if isinstance(body, str):
            return Fragment(_text(body, here))
        body = _object(body, here, required={"text"}, optional={"source"})
        return Fragment(_text(body["text"], f"{here}.text"), str(body.get("source", "")))
    if kind in ("plus", "cross"):
        if not isinstance(body, list) or not body:
            raise QueryError(here, f"{kind} takes a non-empty list of nodes")
        items = tuple(parse(child, f"{here}[{i}]") for i, child in enumerate(body))
        return (Plus if kind == "plus" else Cross)(items)
    if kind == "g":
        body = _object(body, here, required={"input"}, optional=set(_GENERATE_FIELDS))
        return Generate(parse(body["input"], f"{here}.input"), **_generate_params(body, here))
    if kind == "chat":
        body = _object(body, here, required={"messages"}, optional=set(_GENERATE_FIELDS))
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise QueryError(f"{here}.messages", "chat takes a non-empty list of messages")
        nodes = tuple(parse(m, f"{here}.messages[{i}]") for i, m in enumerate(messages))
        return Chat(nodes, _generate_params(body, here))
    if kind == "retrieve":
        if isinstance(body, str):
            return Retrieve(_text(body, here))
        body = _object(body, here, required={"query"}, optional={"corpus", "k"})
        k = body.get("k", 4)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 100:
            raise QueryError(f"{here}.k", "k is an integer in [1, 100]")
        corpus = body.get("corpus")
        if corpus is not None and not isinstance(corpus, str):
            raise QueryError(f"{here}.corpus", "corpus is a path")
        return Retrieve(_text(body["query"], f"{here}.query"), corpus, k)
    raise QueryError(path, f"unknown node type {kind!r}")


def _generate_params(body: dict, path: str) -> dict:
    params = {k: v for k, v in body.items() if k in _GENERATE_FIELDS}
    checks = {
        "max_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "temperature": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2,
        "n": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64,
        "seed": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and -2**53 <= v <= 2**53),
        "stop": lambda v: isinstance(v, (str, list)) and all(isinstance(s, str) and s for s in
                                                              ([v] if isinstance(v, str) else v)),
        "bare": lambda v: isinstance(v, bool),
        "response_format": _response_format,
    }
    for name, value in params.items():
        if not checks[name](value):
            raise QueryError(f"{path}.{name}", f"bad value {value!r}")
    if "stop" in params:
        params["stop"] = (params["stop"],) if isinstance(params["stop"], str) else tuple(params["stop"])
    return params


def _response_format(value) -> bool:
    try:
        from_response_format(value)
    except InvalidGrammarError:
        return False
    return True


def _object(body, path: str, required: set[str], optional: set[str]) -> dict:
    if not isinstance(body, dict):
        raise QueryError(path, f"expected an object with {', '.join(sorted(required))}")
    missing, unknown = required - body.keys(), body.keys() - required - optional
    if missing:
        raise QueryError(path, f"missing {', '.join(sorted(missing))}")
    if unknown:
        raise QueryError(path, f"unknown field {', '.join(sorted(unknown))}")
    return body


def _text(value, path: str) -> str:
    if not isinstance(value, str):
        raise QueryError(path, "expected a string")
    return value


def to_json(node: Node):
    """The wire form of a node (parse(to_json(n)) == n)."""
    if isinstance(node, Message):
        return {node.role: node.text}
    if isinstance(node, Fragment):
        return {"fragment": {"text": node.text, "source": node.source} if node.source else node.text}
    if isinstance(node, Join):
        return {"plus" if isinstance(node, Plus) else "cross": [to_json(c) for c in node.items]}
    if isinstance(node, Generate):
        params = {f: getattr(node, f) for f in _GENERATE_FIELDS if getattr(node, f) != _GENERATE_FIELDS[f].default}
        if "stop" in params:
            params["stop"] = list(params["stop"])
        return {"g": {"input": to_json(node.input), **params}}
    if isinstance(node, Chat):
        return {"chat": {"messages": [to_json(m) for m in node.messages], **node.params}}
    if isinstance(node, Retrieve):
        return {"retrieve": {"query": node.query, "k": node.k, **({"corpus": node.corpus} if node.corpus else {})}}
    raise TypeError(f"not a span query node: {node!r}")


def pretty(node: Node, indent: str = "") -> str:
    """An indented tree, one node per line; long texts are cut."""
    head = _label(node)
    lines = [indent + head]
    for child in node.children:
        lines.append(pretty(child, indent + "  "))
    return "\n".join(lines)


def _label(node: Node) -> str:
    if isinstance(node, Message):
        return f"{node.role} {_short(node.text)}"
    if isinstance(node, Fragment):
        return f"fragment {_short(node.text)}" + (f" [{node.source}]" if node.source else "")
    if isinstance(node, Generate):
        extra = "".join(f" {f}={getattr(node, f)}" for f in ("temperature", "n", "seed", "bare")
                        if getattr(node, f) != _GENERATE_FIELDS[f].default)
        return f"g max_tokens={node.max_tokens}{extra}"
    if isinstance(node, Retrieve):
        return f"retrieve {_short(node.query)} k={node.k}"
    return type(node).__name__.lower()


def _short(text: str, width: int = 48) -> str:
    text = text.replace("\n", " ")
    return repr(text if len(text) <= width else text[: width - 3] + "...")


class QueryError(InvalidRequestError):
    """A malformed span query; the message starts with the path to the bad node."""

    code = "invalid_query"

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
