"""OpenAI-compatible request and response bodies (pydantic), and the mapping to SamplingParams.

The response models document the API (/openapi.json); the routes build plain dicts.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from spanserve.sampling import SamplingParams
from spanserve.structured.params import InvalidGrammarError, StructuredOutputs
from spanserve.tools import Tools, ToolsError

# Seeds, top_k and token ids stay within JSON's safe integers, exact in every client and validator (near
# 2**63 they disagree, as doubles, about which side of the bound a number falls), and within torch's int64.
_SAFE = 2**53


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**bounds):
    """An integer as JSON Schema has it: 5 or 5.0, never true or "5" (the request models are strict).
    The bounds go inside, next to the int, where /openapi.json can show them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _refused(what: str, *neutral):
    """An OpenAI field this server does not implement. Its `neutral` values, which ask for nothing
    (null, empty, the default, or what the server does anyway), pass, and are all /openapi.json
    allows; any other is a 400 naming the field and saying so, never a silent default in place
    of what the client asked for."""
    def check(value):
        if not any(type(value) is type(n) and value == n for n in (None, *neutral)):
            raise PydanticCustomError("unsupported", f"{what} is not supported by this server")
        return value
    schema = {"anyOf": [{"type": "null"}, *({"const": n} for n in neutral)],
              "description": f"Not supported: {what}. Any other value than these is a 400."}
    return Annotated[Any, AfterValidator(check), WithJsonSchema(schema)]


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = _int(ge=0, le=_SAFE)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does: OpenAI SDKs and LangChain send extras. Strict: no silent
    # coercion of "5" or true to 5, or of 0 to false; a body is valid exactly when /openapi.json says so.
    model_config = ConfigDict(extra="ignore", strict=True)


class _Request(_Body):
    """A whole request body: its text must be valid Unicode. JSON's \\ud800 escapes decode to lone
    surrogates, which no tokenizer or encoder takes: refused here, once for the whole tree."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body):
        stack = [(body, "")]
        while stack:
            value, where = stack.pop()
            if isinstance(value, dict):
                stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in value.items())
                stack.extend((k, where or "body") for k in value if isinstance(k, str))
            elif isinstance(value, list):
                stack.extend((v, f"{where}.{i}") for i, v in enumerate(value))
            elif isinstance(value, str) and not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{where or 'body'} is not valid Unicode (a lone surrogate escape such "
                                     f"as \\ud800)") from None
        return body


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` extra: exactly one constraint on the output."""

    json_: dict | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = None
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = Field(None, description="a Lark grammar (llguidance's dialect)")

    def params(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                 choice=self.choice, grammar=self.grammar)


class JsonSchemaSpec(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema


class ResponseFormat(_Body):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def params(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.json_schema is None:
            raise InvalidGrammarError("response_format json_schema needs its json_schema")
        return StructuredOutputs(json=self.json_schema.schema_)


class _SamplingFields(_Body):
    model: str | None = None
    n: _int(ge=1, le=16) = 1
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: _int(ge=-1, le=_SAFE) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: _int(ge=-_SAFE, le=_SAFE) | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: _int(ge=0) = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # identifiers of the end user and the prompt family for OpenAI's monitoring and cache routing: accepted,
    # they change nothing in what is generated (spanserve caches by content for every request)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    logit_bias: _refused("logit_bias", {}) = None
    # as in vLLM: requests share cached KV only with requests of the same salt (within the tenant of the key)
    cache_salt: CacheSalt | None = None
    # spanserve extension: how requests with position-independent spans link them (pic/link.py)
    link_policy: Literal["none", "gap", "blend", "full", "comb", "ape"] | None = None
    gap_length: _int(ge=0, le=_SAFE) | None = None
    blend_ratio: float | None = Field(None, ge=0, le=1)
    blend_layers: _int(ge=1, le=_SAFE) | None = None
    ape_temperature: float | None = Field(None, gt=0, le=1)
    ape_scale: float | None = Field(None, gt=0, le=1)
    focus_spans: _int(ge=0, le=_SAFE) | None = None
    focus_tokens: _int(ge=0, le=_SAFE) | None = None
    # spanserve extension: sparse decode (a flow the server has: built-in or --sparse-flow)
    sparse: NonEmptyStr | None = Field(None, max_length=128)
    sparse_budget: _int(ge=1, le=_SAFE) = 2048
    sparse_prefill: bool = False
    structured_outputs: StructuredOutputsField | None = None  # vLLM's extra

    def structured(self) -> StructuredOutputs | None:
        """The request's constraint on its output, if any."""
        return self.structured_outputs.params() if self.structured_outputs is not None else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
        optional = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                  "link_policy", "gap_length", "blend_ratio", "blend_layers",
                                                  "ape_temperature", "ape_scale", "focus_spans",
                                                  "focus_tokens")
                    if getattr(self, k) is not None}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop,
            # ids beyond the vocabulary can never be sampled (and cannot index the logits)
            stop_token_ids=[t for t in self.stop_token_ids or [] if t < vocab_size],
            ignore_eos=self.ignore_eos, logprobs=logprobs, sparse=self.sparse, sparse_budget=self.sparse_budget,
            sparse_prefill=self.sparse_prefill, structured_outputs=self.structured(), **optional,
        )


class PromptPart(_Body):
    """spanserve extension: one part of a prompt; a span's KV is computed on its own and reused anywhere."""

    text: NonEmptyStr
    span: bool = False


class CompletionRequest(_SamplingFields, _Request):
    # a text, texts, token ids, lists of token ids, or (extension) one prompt as a list of parts; never empty
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)]
             | Annotated[list[NonEmptyStr | PromptPart], Field(min_length=1)])
    # extension: position-independent [start, end) spans of a token-id prompt
    spans: list[Annotated[list[_int(ge=0, le=_SAFE)], Field(min_length=2, max_length=2)]] | None = None
    max_tokens: _int(ge=1) | None = 16
    logprobs: _int(ge=0, le=20) | None = None
    echo: bool = False
    best_of: _refused("best_of other than 1 (several samples, the best returned)", 1) = None
    suffix: _refused("suffix (text after the completion, for insertion)", "") = None


class TextContentPart(_Body):
    type: Literal["text"] = "text"
    text: str
    span: bool = False  # spanserve extension: a position-independent span (a document, a tool output)


class CalledFunction(_Body):
    name: NonEmptyStr
    arguments: str  # a JSON object's text


class MessageToolCall(_Body):
    """A call an assistant message made (OpenAI's tool_calls item)."""

    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: _refused("a message's name (no chat template here renders it)", "") = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: NonEmptyStr | None = None  # a tool message: the call it answers
    function_call: _refused("function_call (deprecated; use tool_calls)") = None
    refusal: _refused("an assistant message's refusal") = None
    audio: _refused("audio") = None


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments
    strict: bool | None = None  # the arguments always match it, under tool_choice required or a named function


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, _Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _int(ge=1) | None = None
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: _int(ge=0, le=20) | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: _refused("functions (deprecated; use tools)", []) = None
    function_call: _refused("function_call (deprecated; use tool_choice)", "none") = None
    modalities: _refused("modalities other than text", ["text"]) = None
    audio: _refused("audio output") = None
    prediction: _refused("prediction (predicted outputs)") = None
    reasoning_effort: _refused("reasoning_effort") = None
    verbosity: _refused("verbosity") = None
    web_search_options: _refused("web_search_options") = None
    store: _refused("store (stored completions)", False) = None
    metadata: _refused("metadata (for stored completions)", {}) = None
    service_tier: _refused("service_tier other than auto or default", "auto", "default") = None

    def chat_messages(self) -> list[dict]:
        return chat_messages(self.messages)

    def tools_of(self) -> Tools | None:
        """The request's tools, which it may or must call (None without tools)."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise ToolsError("tool_choice needs tools")
            return None
        choice = self.tool_choice or "auto"
        return tools_of(self.tools, choice if isinstance(choice, str) else choice.model_dump(),
                        self.parallel_tool_calls is not False)

    def structured(self) -> StructuredOutputs | None:
        formatted = self.response_format.params() if self.response_format is not None else None
        if formatted is not None and self.structured_outputs is not None:
            raise InvalidGrammarError("give response_format or structured_outputs, not both")
        return formatted or super().structured()


def tools_of(tools: list[ToolSpec], choice: str | dict = "auto", parallel: bool = True) -> Tools:
    return Tools([t.model_dump(exclude_none=True) for t in tools], choice, parallel)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them; text parts of a content list are joined, unless
    some are spans (the engine then renders the template around them)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            has_spans = any(p.span for p in content)
            content = [p.model_dump() for p in content] if has_spans else "".join(p.text for p in content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class _TokenizeRequest(_Request):
    # Fields of the other form are an error, not ignored: a body is a prompt or a conversation.
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    return_token_strs: bool = False


class TokenizePromptRequest(_TokenizeRequest):
    """vLLM's /tokenize of a text."""

    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeRequest):
    """vLLM's /tokenize of a conversation, through the model's chat template with the assistant's
    turn opened (what a chat completion prompts with)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None  # shown to the model as a chat completion shows them
    add_generation_prompt: _refused("add_generation_prompt false", True) = None

    def tools_of(self) -> Tools | None:
        return tools_of(self.tools) if self.tools else None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, for the server's embedding model (all-MiniLM-L6-v2, the encoder
    span queries retrieve with): a text, texts, token ids of that model, or lists of them."""

    model: str | None = None
    input: (str | Annotated[list[str], Field(min_length=1, max_length=2048)] | TokenIds
            | Annotated[list[TokenIds], Field(min_length=1, max_length=2048)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Literal[384] | None = None  # all-MiniLM-L6-v2's own size: it has no shorter form
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class SpanQueryRequest(_Request):
    """spanserve extension: run a span query (see the README): its JSON tree under `query`."""

    model: str | None = None
    query: dict
    judge_arity: _int(ge=2, le=1024) | None = None
    stream: bool = False
    cache_salt: CacheSalt | None = None


# ---- responses (documentation of what the routes return) -------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls", "abort"] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    logprobs: CompletionLogprobs | None


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion; with stream=true, `data:` events of the same shape
    (one choice each, `usage` only in the last when stream_options.include_usage), then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    """The body of a non-streamed chat completion; with stream=true, `data:` events of object
    chat.completion.chunk (a `delta` per choice instead of a `message`), then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class SpanCall(BaseModel):
    path: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float | None
    ready_s: float | None = None  # from the last inner call's last token to this call's first


class SpanQueryResponse(BaseModel):
    """The result of a span query; with stream=true, `data:` events {"delta": text} for the root
    call's output, then one {"result": <this object>}, then `data: [DONE]`."""

    object: Literal["span_query"]
    model: str
    text: str
    texts: list[str]
    calls: list[SpanCall]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    version: str


class SessionCreateRequest(_Request):
    """POST /v1/sessions: a streaming session (spanserve extension)."""

    model: str | None = None
    system: str = Field("You are a helpful assistant.", max_length=1 << 16)
    retention_tokens: _int(ge=1, le=_SAFE) | None = None
    flash: list[NonEmptyStr] = Field(default_factory=list, max_length=64)
    flash_max_tokens: _int(ge=1, le=4096) = 64
    # ready-position speculative exit (sessions/ready.py): off without answers
    exit_answers: list[NonEmptyStr] = Field(default_factory=list, max_length=64)
    exit_threshold: float = Field(2.0, ge=0, le=1e6)


class SessionDataRequest(_Request):
    text: NonEmptyStr


class SessionQueryRequest(_SamplingFields, _Request):
    question: NonEmptyStr
    max_tokens: _int(ge=1) = 64
    n: _int(ge=1, le=1) = 1


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"] = "session"
    version: int
    visible_version: int
    num_tokens: int
    frozen_tokens: int
    pending_tokens: int
    evicted_tokens: int
    retention_tokens: int
    flash: list[str]
    flash_tokens_per_append: int  # the work its flash questions set off after each append
    flash_budget_tokens: int  # the most this server lets a session's flash questions set off
    closed: bool
    failed: str | None = None  # why its background work stopped (then it answers 409 until deleted)
    ready_exit: dict | None = None


class SessionAnswer(BaseModel):
    id: str
    object: Literal["session.answer"] = "session.answer"
    session_id: str
    version: int
    flash_hit: bool
    speculative: bool = False
    text: str
    finish_reason: str | None
    usage: Usage | None
