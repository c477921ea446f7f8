"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM engine loop."""

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from spanserve import __version__
from spanserve.engine.async_engine import AsyncLLM
from spanserve.errors import InvalidRequestError
from spanserve.llm import apply_chat_template
from spanserve.outputs import RequestOutput
from spanserve.server import openai_format as fmt
from spanserve.server.metrics import ServerMetrics
from spanserve.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("spanserve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class Server:
    """Request handling shared by the routes: validation, admission, metrics, logging."""

    def __init__(self, llm: AsyncLLM, model_name: str, max_queued: int | None):
        self.llm, self.model_name, self.max_queued = llm, model_name, max_queued
        self.metrics = ServerMetrics()
        self.queued = 0  # admitted requests that have not produced a token yet

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError", "model_not_found")

    def admit(self) -> None:
        if self.max_queued is not None and self.queued >= self.max_queued:
            raise APIError(503, f"server overloaded: {self.queued} requests waiting (--max-queued "
                           f"{self.max_queued}); retry later", "server_overloaded", headers={"Retry-After": "1"})

    def check_length(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        limit = self.llm.engine.max_model_len
        room = limit - len(prompt_ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(prompt_ids) + (max_tokens or 1)} tokens ({len(prompt_ids)} in the prompt, "
                           f"{max_tokens or 1} for the completion).", code="context_length_exceeded")
        return max_tokens if max_tokens is not None else room

    async def run(self, prompt, params, http: Request | None, stream: bool) -> AsyncIterator[RequestOutput]:
        """Run one engine request, keeping metrics and the log line; yields cumulative outputs."""
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        start, status, last = time.monotonic(), "abort", None
        self.queued += 1
        waiting = True
        try:
            async for out in self.llm.generate(prompt, params, request_id):
                if waiting:
                    waiting = False
                    self.queued -= 1
                last = out
                yield out
            status = "ok"
        finally:
            if waiting:
                self.queued -= 1
            self._record(request_id, status, last, time.monotonic() - start)

    def _record(self, request_id: str, status: str, out: RequestOutput | None, elapsed: float) -> None:
        self.metrics.requests[status] += 1
        if out is None:
            log.info("%s %s prompt=0 cached=0 generated=0 total=%.3fs", request_id, status, elapsed)
            return
        generated = sum(len(c.token_ids) for c in out.outputs)
        self.metrics.prompt_tokens += len(out.prompt_token_ids)
        self.metrics.generation_tokens += generated
        self.metrics.cached_tokens += out.num_cached_tokens
        ttft = out.metrics.ttft_s if out.metrics else None
        if ttft is not None:
            self.metrics.ttft.observe(ttft)
            if generated > 1:
                self.metrics.inter_token.observe((elapsed - ttft) / (generated - 1))
        self.metrics.e2e.observe(elapsed)
        log.info("%s %s prompt=%d cached=%d generated=%d ttft=%s total=%.3fs", request_id, status,
                 len(out.prompt_token_ids), out.num_cached_tokens, generated,
                 f"{ttft:.3f}s" if ttft is not None else "-", elapsed)


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
    async def body():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
               max_queued: int | None = None) -> FastAPI:
    app = FastAPI(title="spanserve", version=__version__,
                  description="OpenAI-compatible LLM server with span-aware KV caching")
    server = Server(llm, model_name, max_queued)
    app.state.server = server
    tokenizer = llm.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(_, exc: InvalidRequestError):
        return error_response(400, str(exc))

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind, exc.code, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "error")

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("internal error")
        return error_response(500, "internal server error", "internal_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return server.metrics.render(llm.engine)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "spanserve",
            "max_model_len": llm.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        server.check_model(body.model)
        prompts = fmt.completion_prompts(body.prompt, tokenizer)
        runs = []
        for text, ids in prompts:
            max_tokens = server.check_length(ids, body.max_tokens)
            params = body.sampling_params(max_tokens, body.logprobs)
            server.admit()
            runs.append((text, ids, server.run({"prompt_token_ids": ids}, params, http, body.stream)))
        if body.stream:
            return sse(fmt.stream_completion(runs, body, model_name, tokenizer))
        finals = await asyncio.gather(*(final_output(r, http) for _, _, r in runs))
        return fmt.completion_response(list(zip(runs, finals)), body, model_name, tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        server.check_model(body.model)
        ids = apply_chat_template(tokenizer, body.chat_messages())
        max_tokens = server.check_length(ids, body.max_completion_tokens or body.max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, top)
        server.admit()
        run = server.run({"prompt_token_ids": ids}, params, http, body.stream)
        if body.stream:
            return sse(fmt.stream_chat(run, body, model_name, tokenizer))
        return fmt.chat_response(await final_output(run, http), body, model_name, tokenizer)

    return app
