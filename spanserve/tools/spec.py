"""Tools: the functions a chat offers its model and which it must call (OpenAI's tools,
tool_choice and parallel_tool_calls); Reply: what the model's answer means, its text and its calls.

tool_choice "auto" lets the model write text or calls, and parses what it wrote; "required" and a
named function hold the answer to calls by a grammar, so their arguments always match the
function's schema; "none" leaves the tools out of the prompt (the model cannot call what it is
not shown)."""

import re
import uuid
from dataclasses import dataclass, replace

from spanserve.errors import InvalidRequestError
from spanserve.sampling import SamplingParams
from spanserve.structured.params import StructuredOutputs
from spanserve.tools import hermes

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_NO_PARAMETERS = {"type": "object", "properties": {}}
ENDED_BY_MODEL = ("stop",)  # finish reasons after which a reply's calls are whole


class ToolsError(InvalidRequestError):
    code = "invalid_tools"


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict  # a JSON schema for its arguments (an object)
    description: str | None = None
    strict: bool = False  # its arguments must match the schema

    @classmethod
    def of(cls, tool, where: str) -> "Function":
        """A function from OpenAI's {"type": "function", "function": {...}}."""
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ToolsError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}")
        fn = tool["function"]
        name, parameters = fn.get("name"), fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolsError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -")
        if not isinstance(parameters, dict):
            raise ToolsError(f"{where}.function.parameters must be a JSON schema object")
        description, strict = fn.get("description"), fn.get("strict") or False
        if description is not None and not isinstance(description, str):
            raise ToolsError(f"{where}.function.description must be a string")
        if not isinstance(strict, bool):
            raise ToolsError(f"{where}.function.strict must be a boolean")
        return cls(name, parameters, description, strict)

    def openai(self) -> dict:
        fn = {"name": self.name, **({"description": self.description} if self.description else {}),
              "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", new_call_id())

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Reply:
    content: str | None  # None when the model only called
    tool_calls: list[ToolCall]
    finish_reason: str | None  # "tool_calls" when it called


class Tools:
    """`tools`: OpenAI's list of {"type": "function", "function": {"name", "description",
    "parameters"}}; `choice`: "auto", "none", "required", a function's name or OpenAI's
    {"type": "function", "function": {"name": ...}}; `parallel`: more than one call allowed."""

    def __init__(self, tools: list, choice: str | dict = "auto", parallel: bool = True):
        if not isinstance(tools, list) or not tools:
            raise ToolsError("tools must be a non-empty list")
        self.functions = [Function.of(t, f"tools[{i}]") for i, t in enumerate(tools)]
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ToolsError("tools: two functions share a name")
        self.choice = _choice(choice, names)
        self.parallel = bool(parallel) and self.choice in ("auto", "required")
        if self.choice == "auto" and any(f.strict for f in self.functions):
            raise ToolsError("strict functions need tool_choice required or a named function (where the grammar "
                             "holds the arguments to the schema); under auto the model's arguments are not held")

    @property
    def constrained(self) -> bool:
        """The answer is held to calls by a grammar."""
        return self.choice not in ("auto", "none")

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template shows them to the model (none under tool_choice none)."""
        return None if self.choice == "none" else [f.openai() for f in self.functions]

    def sampling_params(self, params: SamplingParams, markers_are_tokens: bool) -> SamplingParams:
        """`params`, held to calls by a grammar where tool_choice asks for one."""
        if params.structured_outputs is not None and self.choice != "none":
            raise ToolsError("tools with a response format or structured outputs: set tool_choice to none, "
                             "or drop the format")
        if not self.constrained:
            return params
        functions = self.functions if self.choice == "required" else \
            [f for f in self.functions if f.name == self.choice]
        grammar = hermes.grammar(functions, self.parallel, markers_are_tokens)
        return replace(params, structured_outputs=StructuredOutputs(grammar=grammar))

    def reply(self, text: str, finish_reason: str | None, ids: list[str] = ()) -> Reply:
        """What a model's answer means. Calls are read only from an answer the model ended: one
        cut by max_tokens is text, never a call with half its arguments. Under auto, an answer
        whose call blocks do not all parse, or that calls a function not offered, is text (as
        vLLM does); without parallel calls only the first counts. `ids`: the calls' ids already
        sent (a stream's)."""
        if self.choice == "none" or finish_reason not in ENDED_BY_MODEL:
            return Reply(text, [], finish_reason)
        split = hermes.split(text)
        offered = {f.name for f in self.functions}
        if split is None or not split[1] or any(name not in offered for name, _ in split[1]):
            return Reply(text, [], finish_reason)
        before, calls = split
        calls = calls if self.parallel else calls[:1]
        ids = list(ids) + [new_call_id() for _ in calls[len(ids):]]
        return Reply(before.strip() or None, [ToolCall(n, a, i) for (n, a), i in zip(calls, ids)], "tool_calls")


def _choice(choice, names: list[str]) -> str:
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolsError("tool_choice must be auto, none, required or {'type': 'function', "
                             "'function': {'name': ...}}")
        choice = fn["name"]
        if choice in ("auto", "none", "required"):  # a function by that name, not the mode
            raise ToolsError(f"tool_choice names a function {choice!r}, a reserved word")
    if not isinstance(choice, str):
        raise ToolsError("tool_choice must be auto, none, required or a function")
    if choice not in ("auto", "none", "required") and choice not in names:
        raise ToolsError(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})")
    return choice
