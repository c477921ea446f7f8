"""A conversation with tool calls and their results, made ready for the model's chat template.

A template that knows tools (Qwen2.5's) gets them as it expects: the tools beside the messages,
an assistant's calls with their arguments as objects, the results as "tool" messages. A template
that does not (SmolLM2's) gets the same conversation in plain messages, in the Hermes markup a
tool-aware template would write: the tools and how to call them at the end of the system prompt,
past calls in the assistant's text, each result in a user turn between <tool_response> tags."""

import json

from spanserve.tools import hermes
from spanserve.tools.spec import Tools, ToolsError

DEFAULT_SYSTEM = "You are a helpful assistant."


def knows_tools(chat_template: str | None) -> bool:
    """The template renders tools (it reads a `tools` variable)."""
    return "tools" in (chat_template or "")


def for_template(messages: list[dict], tools: Tools | None,
                 chat_template: str | None) -> tuple[list[dict], list | None]:
    """(messages for the template, the tools to hand it). Refuses (ToolsError) a call whose
    arguments are not a JSON object, and a tool result that answers no call before it."""
    shown = tools.template_tools() if tools is not None else None
    messages = _checked(messages)
    if knows_tools(chat_template):
        return messages, shown
    plain = [_plain(m) for m in messages]
    if shown:
        plain = _with_instructions(plain, hermes.instructions(shown))
    return plain, None


def _checked(messages: list[dict]) -> list[dict]:
    called: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ToolsError(f"messages[{i}] must be an object")
        m = dict(m)
        if m.get("tool_calls"):
            if m.get("role") != "assistant":
                raise ToolsError(f"messages[{i}]: only an assistant's message has tool_calls")
            m["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])]
            called.update(c["id"] for c in m["tool_calls"])
        else:
            m.pop("tool_calls", None)  # an empty list: Qwen's template tests it by truth, as none
        if m.get("role") == "tool" and m.get("tool_call_id") not in called:
            raise ToolsError(f"messages[{i}] is a tool result for {m.get('tool_call_id')!r}, which no "
                             f"assistant message before it called")
        if m.get("tool_calls") and m.get("content") is None:  # OpenAI's calls-only message: no text
            m["content"] = ""
        out.append(m)
    return out


def _call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str):
        raise ToolsError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ToolsError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise ToolsError(f"{where}.function.arguments must be a JSON object")
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _plain(m: dict) -> dict:
    """A message without tool fields, for a template that has none (any other field as it was:
    the engine says what is wrong with a malformed message)."""
    role, content = m.get("role"), m.get("content")
    if role == "tool":
        return {"role": "user", "content": _wrapped("<tool_response>\n", content or "", "\n</tool_response>")}
    if m.get("tool_calls"):
        calls = "\n".join(hermes.render(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
        return {"role": role, "content": _wrapped("", content, ("\n" if content else "") + calls)}
    return {k: v for k, v in m.items() if k != "tool_call_id"}


def _wrapped(before: str, content, after: str):
    """Text around a content, a string or a list of parts (spans among them)."""
    if isinstance(content, str):
        return before + content + after
    return [p for p in (before, *content, after) if p != ""]


def _with_instructions(messages: list[dict], instructions: str) -> list[dict]:
    if messages and messages[0].get("role") in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": _wrapped("", first["content"], "\n\n" + instructions)}, *messages[1:]]
    return [{"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{instructions}"}, *messages]


def markers_are_tokens(tokenizer) -> bool:
    """The tokenizer has <tool_call> and </tool_call> as tokens of their own (Qwen2.5's has)."""
    added = tokenizer.get_added_vocab()
    return hermes.OPEN in added and hermes.CLOSE in added


def chat_request(engine, messages: list[dict], params, tools: Tools | None):
    """(prompt, sampling params) of a chat with `tools` (or none) on `engine` (an LLMEngine):
    the conversation through the model's template, the answer held to calls where asked."""
    messages, shown = for_template(messages, tools, engine.tokenizer.chat_template)
    prompt = engine.chat_prompt(messages, shown)
    if tools is not None:
        params = tools.sampling_params(params, markers_are_tokens(engine.tokenizer))
    return prompt, params
