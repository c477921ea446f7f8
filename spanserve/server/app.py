"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM engine loop."""

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from jinja2.exceptions import TemplateError
from starlette.exceptions import HTTPException

from spanserve import __version__, heap
from spanserve.engine import text_bound
from spanserve.engine.async_engine import AsyncLLM
from spanserve.errors import InvalidRequestError, RetryLaterError, TokenIdError
from spanserve.kernels.threads import helper_thread, one_torch_thread
from spanserve.outputs import RequestOutput
from spanserve.server import openai_format as fmt
from spanserve.server.embeddings import add_embedding_routes
from spanserve.server.inspector import add_inspector_routes
from spanserve.server.metrics import ServerMetrics
from spanserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelList,
    SpanQueryRequest,
    SpanQueryResponse,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeResponse,
    Version,
    chat_messages,
)
from spanserve.server.sessions import add_session_routes, session_lifespan
from spanserve.server.tenants import Tenants, cache_salt, tenant_of
from spanserve.sessions.disk import SessionDisk
from spanserve.spans.api import prepare, run_async
from spanserve.spans.ir import Generate, QueryError, generate_nodes
from spanserve.spans.limits import QueryLimits
from spanserve.structured.params import InvalidGrammarError
from spanserve.tools.conversation import for_template, markers_are_tokens

log = logging.getLogger("spanserve.server")
GRAMMAR_COMPILE_S = 10.0  # the longest a request's grammar may take to compile
SSE_KEEPALIVE_S = 15.0  # a quiet stream sends a comment this often (many proxies close one idle 30-60 s)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers


ERROR_500 = {"message": "internal server error", "type": "internal_error", "param": None, "code": None}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class AuthMiddleware:
    """Requires `Authorization: Bearer KEY` of a known key on /v1/* and /inspect (and /metrics unless
    public; the inspector's page also takes the key as a Basic password, with a prompt), and
    records the key's tenant in the request's state. Plain ASGI, not @app.middleware("http"):
    Starlette's BaseHTTPMiddleware hides client disconnects from Request.is_disconnected(), and a
    non-streamed request whose client went away would then run to the end."""

    def __init__(self, app, tenants: Tenants, metrics_public: bool):
        self.app, self.tenants, self.metrics_public = app, tenants, metrics_public

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._guarded(scope["path"]):
            page = _is_inspector(scope["path"])  # a browser's page: its Basic prompt carries the key
            tenant = self.tenants.tenant_of(dict(scope["headers"]).get(b"authorization", b""), basic=page)
            if tenant is None:
                response = error_response(401, "missing or invalid API key", "authentication_error", "invalid_api_key",
                                          headers={"WWW-Authenticate": 'Basic realm="spanserve"'} if page else None)
                return await response(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or path in ("/tokenize", "/detokenize") or _is_inspector(path) or \
            (path == "/metrics" and not self.metrics_public)


def _is_inspector(path: str) -> bool:
    return path == "/inspect" or path.startswith("/inspect/")


def _salt(http: Request, client_salt: str | None) -> str | None:
    """The cache salt of a request: its tenant's namespace (when keys name tenants) and the client's."""
    return cache_salt(tenant_of(http), client_salt)


GIVE_BACK_BYTES = 1 << 20  # a request body past this returns the heap's free memory to the OS after it


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with a 413: by their Content-Length before reading
    any, else once the chunks read pass the limit (the body is read before the app runs, as
    FastAPI would read it anyway; later messages, a disconnect, pass through). Plain ASGI for the
    same reason as APIKeyMiddleware."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
            more = message.get("more_body", False)
        body, chunks = b"".join(chunks), None

        async def replay():
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)
        if size > GIVE_BACK_BYTES:  # the body's copies (its text, its tokens) are garbage by now
            await asyncio.to_thread(heap.give_back)


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, f"request body larger than {limit} bytes (--max-body-mb)", code="body_too_large")


class _Place:
    """A request's place among the waiting: held from admission until its first output or its end."""

    def __init__(self, server: "Server"):
        self.server, self.held = server, 0

    def take(self, sequences: int) -> None:
        self.held = sequences
        self.server.queued += sequences

    def release(self) -> None:
        if self.held:
            self.server.queued -= self.held
            self.held = 0


class Server:
    """Request handling shared by the routes: validation, admission, metrics, logging."""

    def __init__(self, llm: AsyncLLM, model_name: str, max_queued: int | None, limits: QueryLimits):
        self.llm, self.model_name, self.max_queued, self.limits = llm, model_name, max_queued, limits
        self.metrics = ServerMetrics(lambda: llm.engine)
        self.queued = 0  # sequences admitted that have not produced a token yet
        self._places: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # run -> its _Place

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError", "model_not_found")

    def admit(self, runs: list, sequences: int) -> None:
        """Count `runs` (from start; `sequences` engine sequences in all, n of each prompt) as waiting,
        or turn them away: a 400 if they could never fit, a 429 while the queue is full. Checking and
        counting in one step keeps a burst of requests from all passing the check before any is counted."""
        self.check_room(sequences)
        for run in runs:
            self._places[run].take(sequences // len(runs))

    def check_room(self, sequences: int) -> None:
        if self.max_queued is None:
            return
        if sequences > self.max_queued:
            raise APIError(400, f"the request makes {sequences} model sequences; this server queues at most "
                           f"{self.max_queued} (--max-queued)", code="too_many_sequences")
        if self.queued + sequences > self.max_queued:
            raise APIError(429, f"server overloaded: {self.queued} sequences waiting, {sequences} more asked, "
                           f"at most {self.max_queued} (--max-queued); retry later", "server_overloaded",
                           headers={"Retry-After": "1"})

    @contextmanager
    def reserved(self, sequences: int):
        """Hold `sequences` places for the whole of a span query (its calls start as it runs)."""
        self.check_room(sequences)
        self.queued += sequences
        try:
            yield
        finally:
            self.queued -= sequences

    def check_length(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        limit = self.llm.engine.max_model_len
        room = limit - len(prompt_ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(prompt_ids) + (max_tokens or 1)} tokens ({len(prompt_ids)} in the prompt, "
                           f"{max_tokens or 1} for the completion).", code="context_length_exceeded")
        return max_tokens if max_tokens is not None else room

    def start(self, prompt, params, tenant: str | None, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate one engine request now (an invalid one raises InvalidRequestError, a 400, before any
        response starts) and return its cumulative outputs, which keep the metrics and the log line.
        `request_id`: the engine's id of it (the response's id, which the inspector lists)."""
        request_id = request_id or f"cmpl-{uuid.uuid4().hex[:24]}"
        return self.track(request_id, self.llm.submit(prompt, params, request_id, tenant))

    def track(self, request_id: str, outputs: AsyncIterator) -> AsyncIterator:
        """`outputs` of one engine request with its place among the waiting (admit) and its metrics
        and log line (an extension's request too: a question to a session)."""
        place = _Place(self)
        run = self._run(request_id, outputs, place)
        self._places[run] = place
        weakref.finalize(run, place.release)  # a run that never starts (a 429, a client gone) gives it back
        return run

    async def _run(self, request_id: str, outputs: AsyncIterator[RequestOutput],
                   place: "_Place") -> AsyncIterator[RequestOutput]:
        start, status, last = time.monotonic(), "abort", None
        try:
            async for out in outputs:
                place.release()
                last = out
                yield out
            status = "ok"
        except Exception:  # the engine failed it; a cancellation or a closed stream stays "abort"
            status = "error"
            raise
        finally:
            place.release()
            await outputs.aclose()
            self._record(request_id, status, last, time.monotonic() - start)

    def _record(self, request_id: str, status: str, out: RequestOutput | None, elapsed: float) -> None:
        self.metrics.requests.labels(status).inc()
        if not isinstance(out, RequestOutput):  # none, or an answer an extension had kept
            log.info("%s %s prompt=0 cached=0 generated=0 total=%.3fs", request_id, status, elapsed)
            return
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        self.metrics.generation_tokens.inc(generated)
        self.metrics.cached_tokens.inc(out.num_cached_tokens)
        ttft = out.metrics.ttft_s if out.metrics else None
        if ttft is not None:
            self.metrics.ttft.observe(ttft)
            if generated > 1:
                self.metrics.inter_token.observe((elapsed - ttft) / (generated - 1))
        self.metrics.e2e.observe(elapsed)
        log.info("%s %s prompt=%d cached=%d generated=%d ttft=%s total=%.3fs", request_id, status,
                 len(out.prompt_token_ids), out.num_cached_tokens, generated,
                 f"{ttft:.3f}s" if ttft is not None else "-", elapsed)


async def primed(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """`outputs` with its first item awaited now, before a stream's 200: a request the engine
    ends before it starts (no room within admission_timeout_s) is then a 503 with Retry-After."""
    first = await anext(outputs)

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()
    return rest()


async def final_output(outputs: AsyncIterator[RequestOutput], http: Request) -> RequestOutput:
    """Drain a request; if the client goes away first, cancel it (which aborts it in the engine)."""
    async def drain():
        last = None
        async for out in outputs:
            last = out
        return last

    task = asyncio.create_task(drain())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await outputs.aclose()
            raise APIError(499, "client disconnected", "client_closed_request")
    return task.result()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """The chunks as server-sent events, with a `: keep-alive` comment after each SSE_KEEPALIVE_S
    without one (a span query's inner calls, a request preempted and queued again), so that a proxy
    does not close the quiet stream."""
    async def body():
        step = None  # the pending next chunk: it outlives a keep-alive, as cancelling it aborts the request
        try:
            while True:
                step = step or asyncio.ensure_future(anext(chunks, None))
                if not (await asyncio.wait({step}, timeout=SSE_KEEPALIVE_S))[0]:
                    yield ": keep-alive\n\n"
                    continue
                chunk, step = step.result(), None
                if chunk is None:
                    break
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception:  # the status line is sent: report the failure in the stream, as vLLM does
            log.exception("internal error while streaming")
            yield f"data: {json.dumps({'error': ERROR_500})}\n\n"
        finally:
            if step is not None:  # the client left while a chunk was pending: end the request in its task
                step.cancel()
                await asyncio.wait({step})
            await chunks.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_NOT_FIELDS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def _where(loc) -> str:
    """A validation error's location as `field.0.sub`, without "body" and pydantic's union-member tags
    (such as `constrained-str` or `list[int]`)."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _NOT_FIELDS))


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for a body that does not fit the request model; a union lists each alternative."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    param = _where(first.get("loc", ())) or None
    problems = list(dict.fromkeys(f"{_where(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
                                  for e in errors))
    return "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""), param


_ERRORS = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "Invalid request: malformed JSON, a wrong type or value, or a prompt too long for the model"),
    (401, "Missing or wrong API key (when the server runs with --api-key or --api-keys)"),
    (404, "Unknown model, or no such session for this API key"),
    (413, "Request body over --max-body-mb"),
    (429, "Overloaded (more than --max-queued sequences waiting); retry after the Retry-After header"),
)}
_ERRORS[429]["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "string"}}}
# With stream=true: server-sent events (before Open API 3.2, `schema` describes one event), each
# `data` a JSON chunk, the last `[DONE]`.
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk as JSON, or [DONE] at the end"}}}}}


def _lifespan(llm: AsyncLLM, disk: SessionDisk | None):
    """The sessions' lifespan, with the event loop's helper threads (asyncio.to_thread: texts to
    tokenize, files to write) running torch on one thread each: a parallel op there would start a
    second OpenMP team beside the engine's, which slows every step (kernels/threads.py)."""
    sessions = session_lifespan(llm, disk)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        helpers = ThreadPoolExecutor(thread_name_prefix="spanserve-helper", initializer=one_torch_thread)
        asyncio.get_running_loop().set_default_executor(helpers)
        async with sessions(app):
            yield

    return lifespan


def create_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
               max_queued: int | None = None, retriever=None, max_body_bytes: int = 32 << 20,
               query_limits: QueryLimits | None = None, tenants: Tenants | None = None,
               metrics_public: bool = False, session_dir: str | Path | SessionDisk | None = None) -> FastAPI:
    """api_key: one key (tenant "default"); tenants: keys by tenant (server/tenants.py), whose caches
    never mix. With neither, the server is open and /metrics too. session_dir: where sessions are
    saved, and kept across a restart (a directory, or a SessionDisk with a save policy)."""
    disk = session_dir if isinstance(session_dir, SessionDisk | None) else SessionDisk(Path(session_dir))
    app = FastAPI(title="spanserve", version=__version__, lifespan=_lifespan(llm, disk),
                  description="OpenAI-compatible LLM server with span-aware KV caching")
    server = Server(llm, model_name, max_queued, query_limits or QueryLimits())
    app.state.server = server
    tokenizer = llm.tokenizer
    vocab_size = llm.engine.model_config.vocab_size

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(_, exc: InvalidRequestError):
        status = getattr(exc, "status", 400)
        retry = {"Retry-After": str(exc.retry_after)} if hasattr(exc, "retry_after") else None
        return error_response(status, str(exc), "NotFoundError" if status == 404 else "invalid_request_error",
                              code=getattr(exc, "code", None), headers=retry)

    @app.exception_handler(RetryLaterError)
    async def _retry_later(_, exc: RetryLaterError):
        return error_response(exc.status, str(exc), "server_overloaded", exc.code,
                              headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind, exc.code, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_, exc: HTTPException):
        """Unknown path (404), unsupported method (405, with Allow), or a body FastAPI could not
        parse (400: e.g. JSON nested deeper than the parser goes)."""
        if exc.status_code == 400:
            return error_response(400, f"request body could not be parsed as JSON ({exc.detail})")
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "error",
                              headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("internal error")
        return JSONResponse({"error": ERROR_500}, status_code=500)

    tenants = tenants or Tenants.load(api_key)
    if tenants:
        app.add_middleware(AuthMiddleware, tenants=tenants, metrics_public=metrics_public)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # outermost: before the key is read

    add_session_routes(app, server, llm, disk, errors=_ERRORS, sse=sse, final_output=final_output)
    add_embedding_routes(app, errors=_ERRORS)
    add_inspector_routes(app, llm, sse)

    @app.get("/health")
    async def health() -> Health:
        return Health(status="ok")

    @app.get("/version")
    async def version() -> Version:
        return Version(version=__version__)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest) -> TokenizeResponse:
        """A text's or a conversation's token ids, as the engine would prompt with them (vLLM's route)."""
        server.check_model(body.model)

        def ids() -> list[int]:
            if isinstance(body, TokenizeChatRequest):
                messages, shown = for_template(chat_messages(body.messages), body.tools_of(), tokenizer.chat_template)
                return llm.engine.chat_prompt(messages, shown)["prompt_token_ids"]
            text_bound.refuse_beyond(len(body.prompt), llm.engine.max_model_len, tokenizer)
            return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

        tokens = await asyncio.to_thread(ids)
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=llm.engine.max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(body.model)
        if any(t >= vocab_size for t in body.tokens):
            raise TokenIdError(f"token ids must be below the vocabulary size {vocab_size}")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text exposition format."""
        return PlainTextResponse(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models", responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        return ModelList.model_validate({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "spanserve",
            "max_model_len": llm.engine.max_model_len}]})

    async def compile_grammar(spec) -> None:
        """A request's grammar compiled (and cached) off the event loop, in a bounded time: a bad
        one is a 400 here. (A compile past the bound runs on in its thread, and is cached.)"""
        if spec is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(llm.engine.grammars.grammar, spec), GRAMMAR_COMPILE_S)
        except TimeoutError:
            raise InvalidGrammarError(f"the grammar did not compile within {GRAMMAR_COMPILE_S:g} s") from None

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse, "content": _SSE}, **_ERRORS})
    async def completions(body: CompletionRequest, http: Request):
        server.check_model(body.model)
        # Tokenizing a long text takes a while: off the event loop, which other clients share.
        prompts = await asyncio.to_thread(fmt.completion_prompts, body.prompt, body.spans, llm.engine)
        await compile_grammar(body.structured())
        salt = _salt(http, body.cache_salt)
        runs, response_id = [], f"cmpl-{uuid.uuid4().hex[:24]}"  # the engine's id of its (first) prompt
        for i, (text, prompt) in enumerate(prompts):  # validate every prompt before any starts
            prompt["cache_salt"] = salt
            ids = prompt["prompt_token_ids"]
            max_tokens = server.check_length(ids, body.max_tokens)
            params = body.sampling_params(max_tokens, body.logprobs, vocab_size)
            request_id = f"{response_id}-p{i}" if i else response_id  # (-{k}: the k-th of n samples)
            runs.append((text, ids, server.start(prompt, params, tenant_of(http), request_id)))
        server.admit([run for _, _, run in runs], len(runs) * body.n)
        if body.stream:
            started = await asyncio.gather(*(primed(run) for _, _, run in runs))
            runs = [(text, ids, run) for (text, ids, _), run in zip(runs, started)]
            return sse(fmt.stream_completion(runs, body, model_name, tokenizer, response_id))
        finals = await asyncio.gather(*(final_output(r, http) for _, _, r in runs))
        return fmt.completion_response(list(zip(runs, finals)), body, model_name, tokenizer, response_id)

    @app.post("/v1/chat/completions",
              responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        server.check_model(body.model)
        tools = body.tools_of()
        messages, shown = for_template(body.chat_messages(), tools, tokenizer.chat_template)
        try:
            prompt = await asyncio.to_thread(llm.engine.chat_prompt, messages, shown)
            prompt["cache_salt"] = _salt(http, body.cache_salt)
        except TemplateError as exc:  # e.g. a template that insists on alternating user/assistant turns
            raise InvalidRequestError(f"the model's chat template rejected the messages: {exc}") from exc
        max_tokens = server.check_length(prompt["prompt_token_ids"], body.max_completion_tokens or body.max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, top, vocab_size)
        if tools is not None:
            params = tools.sampling_params(params, markers_are_tokens(tokenizer))
        await compile_grammar(params.structured_outputs)
        response_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"  # the engine's id of it too
        run = server.start(prompt, params, tenant_of(http), response_id)
        server.admit([run], body.n)
        if body.stream:
            return sse(fmt.stream_chat(await primed(run), body, model_name, tokenizer, response_id, tools))
        return fmt.chat_response(await final_output(run, http), body, model_name, tokenizer, response_id, tools)

    @app.post("/v1/spans", responses={200: {"model": SpanQueryResponse, "content": _SSE}, **_ERRORS})
    async def span_query(body: SpanQueryRequest, http: Request):
        """Run a span query: inner calls batched, their KV reused by the calls that read them."""
        server.check_model(body.model)
        # A bad query is a 400 here, before any call runs; retrieval embeds text and the limits
        # tokenize it, so both run off the event loop.
        tree, calls = await asyncio.to_thread(_checked_query, body)
        salt = _salt(http, body.cache_salt)
        if body.stream:
            server.check_room(calls)  # a 400 or 429 before the stream's 200
            return sse(_stream_query(tree, calls, salt, tenant_of(http)))
        with server.reserved(calls):
            task = asyncio.create_task(run_async(llm, tree, cache_salt=salt, tenant=tenant_of(http)))
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await http.is_disconnected():
                    task.cancel()  # aborts every call still running
                    await asyncio.gather(task, return_exceptions=True)
                    raise APIError(499, "client disconnected", "client_closed_request")
            return _query_body(task.result())

    def _checked_query(body: SpanQueryRequest):
        with helper_thread():  # the retriever's embedding model must not start a thread team
            tree = prepare(body.query, retriever, body.judge_arity).tree
        if not isinstance(tree, Generate):
            raise QueryError("$", "the root of a span query is a g or a chat")
        for spec in filter(None, (node.structured() for node in generate_nodes(tree))):
            llm.engine.grammars.grammar(spec)  # a bad response_format is a 400 before any call runs
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        return tree, server.limits.check(tree, llm.engine.max_model_len, count)

    async def _stream_query(tree, calls: int, salt: str | None, tenant: str | None) -> AsyncIterator[dict]:
        with server.reserved(calls):
            async for chunk in _query_chunks(tree, salt, tenant):
                yield chunk

    async def _query_chunks(tree, salt: str | None, tenant: str | None) -> AsyncIterator[dict]:
        deltas: asyncio.Queue = asyncio.Queue()
        shown = 0

        def on_root(out: RequestOutput) -> None:
            nonlocal shown
            text = out.outputs[0].text
            if len(text) > shown:
                deltas.put_nowait({"delta": text[shown:]})
                shown = len(text)

        task = asyncio.create_task(run_async(llm, tree, on_root, cache_salt=salt, tenant=tenant))
        getter: asyncio.Task | None = None
        try:
            while not task.done() or not deltas.empty():
                getter = asyncio.create_task(deltas.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            yield {"result": _query_body(task.result())}
        finally:  # a client gone mid-stream: nothing of this query is left pending
            task.cancel()
            if getter is not None:
                getter.cancel()

    def _query_body(result) -> dict:
        return {"object": "span_query", "model": model_name, **result.to_json()}

    generate_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's schema, without the 422 it adds to every route with a body (bad bodies get a 400)."""
        if app.openapi_schema is None:
            schema = generate_openapi()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            # prompt token ids index this model's vocabulary (the request model only knows that they are >= 0)
            for alternative in schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
                items = alternative.get("items", {})
                items = items.get("items", items)
                if items.get("type") == "integer":
                    items["maximum"] = vocab_size - 1
        return app.openapi_schema

    app.openapi = openapi
    return app
