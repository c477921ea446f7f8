"""The ingress: every HTTP request, forwarded to a replica, with what the router needs to pick one.

A catch-all FastAPI route (no routes, docs or schema of its own: /openapi.json is a replica's)
computes the request's routing keys (keys.py) and, for a session's routes, the replica that holds
the session, and calls the replicas' `forward` with them; the router (router.py) reads both from
the call. The response streams back as the replica sends it, with `x-spanserve-replica` naming
the replica that answered.

Sessions live in one replica's engine, so the ingress keeps which replica opened each (a replica
that dies takes its sessions with it: they are not restored elsewhere yet).
"""

import asyncio
import json
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from spanserve.cluster.keys import RequestKeys
from spanserve.cluster.replica import ServerOptions
from spanserve.models.loader import load_tokenizer, resolve_model
from spanserve.server.tenants import cache_salt

log = logging.getLogger("spanserve.cluster")
app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)(/[a-z]+)?")  # a session's routes: its id, then what
REPLICA_HEADER = "x-spanserve-replica"
KEYS_RETRY_S = 30.0  # after a failure to make the hasher, requests go by load alone this long
# (serve.ingress pickles the class as it is decorated: what its methods call is defined above it)
FAILED = ("the replica serving this request failed; retry", "server_unavailable", "replica_failed")
INTERNAL = ("internal server error", "internal_error", None)


def _error_body(message: str, kind: str, code: str | None) -> dict:
    """An OpenAI-shaped error, as the replicas' own (server/app.py)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error(status: int, message: str, kind: str, code: str | None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, code), status_code=status,
                        headers={"Retry-After": "1"} if status == 503 else None)


class _Relay(StreamingResponse):
    """A StreamingResponse that does not read the request for a disconnect while it streams: under
    Serve that read raises once the client is gone (TaskCancelledError, logged as never retrieved),
    and Serve cancels this request's task on a disconnect anyway, which closes the replica's stream."""

    async def __call__(self, scope, receive, send):
        await self.stream_response(send)


def _streamed(status: int, headers: list, chunks, sse: bool) -> _Relay:
    """The replica's response as it comes. A failure mid-way ends it (the status line is sent):
    an event stream's last event then says why, as the single-process server's does."""
    async def body():
        done = False
        try:
            async for chunk in chunks:
                yield chunk
            done = True
        except Exception as exc:  # noqa: BLE001 - the client gets the error event, the log the cause
            died = isinstance(exc, RayActorError)
            log.warning("%s while streaming an answer: %s", "replica failed" if died else "error", exc)
            if sse:
                yield b"data: " + json.dumps(_error_body(*(FAILED if died else INTERNAL))).encode() + b"\n\n"
        finally:
            if not done and hasattr(chunks, "cancel"):
                chunks.cancel()  # a client gone mid-stream: the replica's request is aborted

    response = _Relay(body(), status_code=status)
    response.raw_headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    return response


@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, options: ServerOptions, model: str | None):
        self.replicas = replicas.options(method_name="forward", stream=True)
        self.hash_context = replicas.options(method_name="hash_context")
        self.options, self.model, self.tenants = options, model, options.tenants()
        self.sessions: dict[str, str] = {}  # session id -> the unique id of the replica holding it
        self._keys: RequestKeys | None = None
        self._keys_ready, self._keys_retry_at = asyncio.Lock(), 0.0

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def forward(self, request: Request, path: str):
        body, path = await request.body(), request.url.path
        session = SESSION_PATH.fullmatch(path)
        pin = self.sessions.get(session.group(1)) if session else None
        keys = await self._request_keys(path, body, request) if request.method == "POST" else []
        call = (request.method, path, request.url.query.encode(), request.headers.raw, body)
        for attempt in (1, 2):
            stream = self.replicas.remote(*call, keys=keys, pin=pin)
            try:
                head = await anext(stream)
                break
            except asyncio.CancelledError:  # the client left before the answer began (Serve cancels us)
                stream.cancel()  # ... so the replica's request ends too
                raise
            except RayActorError as exc:  # the replica died before answering: nothing of it ran to the end
                log.warning("replica failed before answering %s %s: %s", request.method, path, exc)
                if pin is not None or attempt == 2:
                    return error(503, *FAILED)
            except Exception:  # noqa: BLE001 - not the client's doing: a 500 shaped as the replicas' own
                log.exception("forwarding %s %s failed", request.method, path)
                return error(500, *INTERNAL)
        headers = [(name, value) for name, value in head["headers"] if name.lower() != REPLICA_HEADER]
        headers.append((REPLICA_HEADER, head["replica"]))
        opens = request.method == "POST" and (path == "/v1/sessions" or session and session.group(2) == "/restore")
        closes = request.method == "DELETE" and session and not session.group(2)
        if head["status"] == 200 and (opens or closes):
            return await self._session_answer(head, headers, stream)
        sse = any(name.lower() == "content-type" and value.startswith("text/event-stream") for name, value in headers)
        return _streamed(head["status"], headers, stream, sse)

    async def _session_answer(self, head: dict, headers: list, stream):
        """A session opened, restored or closed: note where it lives (the answer is small JSON)."""
        try:
            body = b"".join([chunk async for chunk in stream])
        except RayActorError:
            return error(503, *FAILED)
        try:
            answer = json.loads(body)
        except ValueError:
            answer = {}
        if answer.get("deleted"):
            self.sessions.pop(answer.get("id"), None)
        elif answer.get("object") == "session" and "id" in answer:
            self.sessions[answer["id"]] = head["replica"]

        async def once():
            yield body
        return _streamed(head["status"], headers, once(), sse=False)

    async def _request_keys(self, path: str, body: bytes, request: Request) -> list[str]:
        if path not in ("/v1/completions", "/v1/chat/completions") or len(body) > self.options.max_body_bytes:
            return []
        keys = await self._keys_of_engine()
        if keys is None:
            return []
        auth = request.headers.get("authorization", "").encode("latin-1")
        tenant = self.tenants.tenant_of(auth) if self.tenants else None
        # tokenizing a long prompt takes a while: off the event loop
        return await asyncio.to_thread(keys, path, body, lambda client_salt: cache_salt(tenant, client_salt))

    async def _keys_of_engine(self) -> RequestKeys | None:
        """The hasher, made at the first request that needs it: the tokenizer, and the hash context
        a replica reports (None, and routing by load alone, while that fails)."""
        async with self._keys_ready:
            if self._keys is None and time.monotonic() >= self._keys_retry_at:
                try:
                    ctx = await self.hash_context.remote()
                    tokenizer = await asyncio.to_thread(lambda: load_tokenizer(resolve_model(self.model, False)))
                    self._keys = RequestKeys(tokenizer, ctx)
                except Exception:  # noqa: BLE001 - routing degrades to load; requests still work
                    log.exception("no routing keys for %.0f s: requests are routed by load alone", KEYS_RETRY_S)
                    self._keys_retry_at = time.monotonic() + KEYS_RETRY_S
            return self._keys
