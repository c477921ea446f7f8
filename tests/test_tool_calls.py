"""Tool calling (spanserve/tools/): the markup read and written, tool_choice required and a named
function held by the grammar to calls whose arguments match their schema (on random models that
know nothing of tools, with and without tool-call tokens), conversations with calls and results
through both kinds of chat template, and the OpenAI server's tools, tool_choice, tool messages
and streamed tool-call deltas."""

import json

import httpx
import jsonschema_rs
import openai
import pytest
from helpers import assert_engine_idle
from server_utils import ServerProcess, assert_openai_error

from spanserve import LLM, SamplingParams, Tools
from spanserve.tools import ToolsError, hermes
from spanserve.tools.conversation import for_template
from spanserve.tools.stream import ToolStream

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                      "b": {"type": "integer", "minimum": -999, "maximum": 999}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": jsonschema_rs.validator_for(WEATHER), "add": jsonschema_rs.validator_for(ADD)}
ASKED = [{"role": "user", "content": "What's the weather in Paris?"}]
CALLED = ASKED + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'}]


def _valid_calls(reply, names=("get_weather", "add")) -> bool:
    return reply.finish_reason == "tool_calls" and reply.tool_calls and all(
        c.name in names and SCHEMAS[c.name].is_valid(json.loads(c.arguments)) for c in reply.tool_calls)


# ---- the markup, the choice and the reply, without a model -----------------------------------------

@pytest.mark.parametrize("text, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', [("add", '{"a": 1, "b": 2}')]),
    ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>', [("add", '{"a": 1, "b": 2}')]),
    ('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', [("add", '{"a": 1, "b": 2}')]),  # bare, fenced
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', [("add", '{"a": 1, "b": 2}')]),
    ("The answer is 3.", []),
    ('{"a": 1}', []),  # JSON, but not a call
])
def test_the_markup_is_read(text, calls):
    assert hermes.split(text)[1] == calls


def test_a_broken_call_block_is_not_a_call():
    assert hermes.split('<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>') is None
    reply = Tools(TOOLS).reply('<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>', "stop")
    assert reply.tool_calls == [] and reply.content.startswith("<tool_call>") and reply.finish_reason == "stop"


def test_the_reply_reads_calls_only_from_an_answer_the_model_ended():
    tools, text = Tools(TOOLS), '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    reply = tools.reply(text, "stop")
    assert (reply.content, reply.finish_reason, reply.tool_calls[0].name) == (None, "tool_calls", "add")
    assert reply.tool_calls[0].openai()["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert tools.reply(text, "length").tool_calls == []  # cut by max_tokens: text, never a call
    assert Tools(TOOLS, "none").reply(text, "stop").tool_calls == []
    assert Tools(TOOLS).reply(text.replace("add", "rm_rf"), "stop").tool_calls == []  # a function not offered
    two = text + "\n" + text
    assert len(Tools(TOOLS).reply(two, "stop").tool_calls) == 2
    assert len(Tools(TOOLS, parallel=False).reply(two, "stop").tool_calls) == 1


@pytest.mark.parametrize("tools, choice, message", [
    ([], "auto", "non-empty"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto", "letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "JSON schema"),
    ([{"type": "retrieval"}], "auto", "must be"),
    (TOOLS + TOOLS[:1], "auto", "share a name"),
    (TOOLS, "delete_everything", "not among the tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    (TOOLS, {"type": "function"}, "tool_choice must be"),
    ([{"type": "function", "function": {"name": "f", "strict": True}}], "auto", "strict functions need"),
])
def test_bad_tools_are_clear_errors(tools, choice, message):
    with pytest.raises(ToolsError, match=message):
        Tools(tools, choice)


def test_a_tool_result_must_answer_an_earlier_call():
    with pytest.raises(ToolsError, match="no assistant message before it called"):
        for_template(ASKED + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], None, None)
    bad_arguments = [ASKED[0], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]
    with pytest.raises(ToolsError, match="not valid JSON"):
        for_template(bad_arguments, None, None)


def test_a_template_without_tools_gets_them_in_plain_messages():
    messages, shown = for_template(CALLED, Tools(TOOLS), chat_template="{{ messages }}")
    assert shown is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == hermes.render("get_weather", {"city": "Paris"})
    assert messages[3]["content"].startswith("<tool_response>\n") and "sunny" in messages[3]["content"]
    messages, shown = for_template(CALLED, Tools(TOOLS), chat_template="{% if tools %}{% endif %}")
    assert shown == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert for_template(CALLED, Tools(TOOLS, "none"), chat_template="{{ messages }}")[0][0]["role"] == "user"


def _streamed(tools: Tools, text: str, finish_reason: str = "stop", step: int = 3):
    """What a client rebuilds from the deltas of `text` fed `step` characters at a time."""
    stream, deltas = ToolStream(tools), []
    for end in range(step, len(text), step):
        deltas += stream.feed(text[:end])
    last, finish = stream.end(text, finish_reason)
    content, calls = "", {}
    for delta in deltas + last:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
            assert call.get("id") in (None, entry["id"])  # the id comes with a call's first delta only
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call["function"].get("arguments", "")
    return content, [calls[k] for k in sorted(calls)], finish, len(deltas)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_deltas_add_up_to_the_reply(choice):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 32}}\n</tool_call>')
    content, calls, finish, early = _streamed(Tools(TOOLS, choice), text)
    reply = Tools(TOOLS, choice).reply(text, "stop")
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in reply.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)
    if choice == "required":  # held by the grammar: the arguments stream as they are written
        assert early > 4


def test_streamed_text_is_content_and_a_cut_call_says_length():
    assert _streamed(Tools(TOOLS), "It is sunny in Paris.")[:3] == ("It is sunny in Paris.", [], "stop")
    content, calls, finish, _ = _streamed(Tools(TOOLS), '<tool_call>\n{"name": "add", "argu', "length")
    assert (content, calls, finish) == ('<tool_call>\n{"name": "add", "argu', [], "length")


# ---- on a model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)


@pytest.fixture(scope="module")
def tools_llm(tiny_tools_model_path):
    return LLM(model=str(tiny_tools_model_path), dtype="float32", num_blocks=256)


@pytest.mark.parametrize("model", ["llm", "tools_llm"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_required_and_named_choices_always_call_with_valid_arguments(request, model, choice):
    """A random model, sampled at temperature 1, still calls only offered functions with arguments
    valid against their schemas: the grammar holds it."""
    llm = request.getfixturevalue(model)
    tools = Tools(TOOLS, choice)
    outs = llm.chat([ASKED] * 3, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=160), tools=tools)
    replies = [tools.reply(c.text, c.finish_reason) for out in outs for c in out.outputs]
    ended = [r for r in replies if r.finish_reason != "length"]
    assert len(ended) >= len(replies) // 2
    names = ("get_weather", "add") if choice == "required" else ("add",)
    assert all(_valid_calls(r, names) for r in ended), ended
    assert_engine_idle(llm)


def test_tool_call_tokens_are_written_as_tokens(tools_llm):
    tokenizer = tools_llm.get_tokenizer()
    out = tools_llm.chat(ASKED, SamplingParams(temperature=0, max_tokens=80), tools=Tools(TOOLS, "add"))[0]
    assert out.outputs[0].token_ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>")


def test_a_conversation_with_calls_reaches_each_template(llm, tools_llm):
    plain = llm.get_tokenizer().decode(llm.apply_chat_template(CALLED, tools=Tools(TOOLS)))
    assert "<tool_response>" in plain and '"name": "get_weather"' in plain and "Weather now" in plain
    aware = tools_llm.get_tokenizer().decode(tools_llm.apply_chat_template(CALLED, tools=Tools(TOOLS)))
    assert "Functions you may call" in aware and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in aware
    assert "Functions you may call" not in tools_llm.get_tokenizer().decode(
        tools_llm.apply_chat_template(CALLED, tools=Tools(TOOLS, "none")))


def test_tools_and_a_response_format_are_refused_together(llm):
    with pytest.raises(ToolsError, match="tool_choice to none"):
        llm.chat(ASKED, SamplingParams(max_tokens=4, structured_outputs={"json_object": True}), tools=Tools(TOOLS))


# ---- over HTTP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["tiny_llama_path", "tiny_tools_model_path"])
def server(request, tmp_path_factory):
    path = request.getfixturevalue(request.param)
    server = ServerProcess(["--model", str(path), "--dtype", "float32", "--num-blocks", "256"],
                           tmp_path_factory.mktemp("tools-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _check_calls(calls, names=("get_weather", "add")):
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        assert SCHEMAS[call.function.name].is_valid(json.loads(call.function.arguments))


def test_the_server_calls_tools(client, model):
    r = client.chat.completions.create(model=model, messages=ASKED, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0.8, seed=1, n=2, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(model=model, messages=CALLED, tools=TOOLS, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.choices[0].finish_reason == "tool_calls"
    _check_calls(named.choices[0].message.tool_calls, ("add",))
    assert len(named.choices[0].message.tool_calls) == 1
    plain = client.chat.completions.create(model=model, messages=CALLED, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


def test_the_server_streams_tool_call_deltas(client, model):
    stream = client.chat.completions.create(model=model, messages=ASKED, tools=TOOLS, max_tokens=120, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "add"}})
    calls, finish, chunks = {}, None, 0
    for chunk in stream:
        for choice in chunk.choices:
            chunks += 1
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and chunks > 3
    assert calls[0]["name"] == "add" and calls[0]["id"].startswith("call_")
    assert SCHEMAS["add"].is_valid(json.loads(calls[0]["arguments"]))


@pytest.mark.parametrize("body, message, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools", None),
    ({"tool_choice": "required"}, "needs tools", None),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice to none",
     None),
    ({"messages": ASKED + [{"role": "tool", "tool_call_id": "call_7", "content": "x"}]}, "no assistant message", None),
    ({"messages": CALLED[:2] + [{"role": "tool", "content": "x"}]}, "no assistant message", None),
    ({"tools": [{"type": "function"}]}, "function", "tools.0.function"),
])
def test_bad_tool_requests_are_400s(server, body, message, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASKED, "max_tokens": 4, **body})
    error = assert_openai_error(r, 400, message)
    if param:
        assert error["param"] == param


def test_tokenize_renders_tools(server):
    with_tools = httpx.post(f"{server.url}/tokenize", json={"messages": CALLED, "tools": TOOLS}).json()
    without = httpx.post(f"{server.url}/tokenize", json={"messages": CALLED}).json()
    assert with_tools["count"] > without["count"]


# ---- the CLI ------------------------------------------------------------------------------------

def test_the_cli_prints_the_calls(tiny_llama_path, tmp_path, capsys, monkeypatch):
    from spanserve.cli import main

    tools = tmp_path / "tools.json"
    digit = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "add", "parameters": digit}}]))
    common = ["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "64", "--temperature", "0",
              "--max-tokens", "60", "--tools", f"@{tools}", "--system", ""]
    main(["generate", "Add 2 and 3.", *common, "--tool-choice", "add"])
    call = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"])["a"] in range(10)
    # chat: the user answers the call, the model goes on from the result
    lines, prompts = iter(["Add 2 and 3.", "5"]), []

    def typed(prompt=""):
        prompts.append(prompt)
        try:
            return next(lines)
        except StopIteration:  # the user is done: Ctrl-D
            raise EOFError from None
    monkeypatch.setattr("builtins.input", typed)
    main(["chat", *common, "--tool-choice", "required", "--no-parallel-tool-calls"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"id"')]
    assert prompts[:2] == ["\n> ", "add result> "] and printed[0]["function"]["name"] == "add"
    with pytest.raises(SystemExit, match="not among the tools"):
        main(["generate", "x", *common, "--tool-choice", "nope"])
