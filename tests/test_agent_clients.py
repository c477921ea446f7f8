"""The agent frameworks' own clients against a real `spanserve serve` on loopback: the official
openai SDK (chat.completions.parse with a pydantic model, pydantic function tools, a streamed
tool call) and LangChain's ChatOpenAI (with_structured_output, bind_tools). A random model
knows nothing of these formats: every answer is well-formed because the grammar holds it."""

import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import ServerProcess

langchain_openai = pytest.importorskip("langchain_openai")


class City(BaseModel):
    """A city and how many people live there."""

    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**8)


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(ge=-999, le=999)
    b: int = Field(ge=-999, le=999)


ASK = [{"role": "user", "content": "Which city, and how many people? Then add 2 and 3."}]


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "256"],
                           tmp_path_factory.mktemp("clients-server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_openai_parse_returns_the_pydantic_model(client, model):
    for seed in range(3):
        completion = client.chat.completions.parse(model=model, messages=ASK, response_format=City,
                                                   max_tokens=100, temperature=1.0, seed=seed)
        assert isinstance(completion.choices[0].message.parsed, City)


def test_openai_pydantic_function_tools_parse_and_stream(client, model):
    tools = [openai.pydantic_function_tool(Add), openai.pydantic_function_tool(City)]  # (strict: true)
    completion = client.chat.completions.parse(model=model, messages=ASK, tools=tools, tool_choice="required",
                                               max_tokens=100, temperature=1.0, seed=4, parallel_tool_calls=False)
    call = completion.choices[0].message.tool_calls[0]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, Add if call.function.name == "Add" else City)
    with client.chat.completions.stream(model=model, messages=ASK, tools=tools, max_tokens=100,
                                        tool_choice={"type": "function", "function": {"name": "Add"}}) as stream:
        deltas = sum(1 for event in stream if event.type == "tool_calls.function.arguments.delta")
        final = stream.get_final_completion()
    assert deltas > 1  # the arguments arrive in pieces, as they are generated
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, Add)
    with pytest.raises(openai.BadRequestError, match="strict functions need"):
        client.chat.completions.create(model=model, messages=ASK, tools=tools, max_tokens=8)  # auto: not held


@pytest.fixture(scope="module")
def chat_model(server, model):
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="x", model=model, max_tokens=100,
                                       temperature=0, max_retries=0, timeout=120)


def test_langchain_with_structured_output(chat_model):
    city = chat_model.with_structured_output(City).invoke("Which city, and how many people?")
    assert isinstance(city, City)


def test_langchain_bind_tools(chat_model):
    message = chat_model.bind_tools([Add], tool_choice="Add").invoke("Add 2 and 3.")
    assert [call["name"] for call in message.tool_calls] == ["Add"]
    Add(**message.tool_calls[0]["args"])  # valid arguments
    required = chat_model.bind_tools([Add, City], tool_choice="any", parallel_tool_calls=False).invoke("Add 2 and 3.")
    assert len(required.tool_calls) == 1 and required.tool_calls[0]["name"] in ("Add", "City")
