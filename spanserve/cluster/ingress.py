"""The ingress: every HTTP request, forwarded to a replica, with what the router needs to pick one.

A catch-all FastAPI route (no routes, docs or schema of its own: /openapi.json is a replica's)
computes the request's routing keys (keys.py) and, for a session's routes, the replica that holds
the session, and calls the replicas' `forward` with them; the router (router.py) reads both from
the call. The response streams back as the replica sends it, with `x-spanserve-replica` naming
the replica that answered.

Sessions live in one replica's engine, so the ingress keeps which replica holds each, for whom,
and the last data version it told the client. When that replica is gone, the next call on the
session restores it on a live replica from its last save (with --session-dir, which the replicas
save into: server/sessions.py) and goes on there; a client whose appends came after that save gets
one 409 naming the version the session now has. Without saves: 410 Gone.
"""

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from spanserve.cluster import routing_state
from spanserve.cluster.keys import RequestKeys, Routing
from spanserve.cluster.metrics import cluster_metrics
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
OWNER_GONE = "owner gone"  # _send's answer for a session call whose replica is dead or gone


def _error_body(message: str, kind: str, code: str | None, **extra) -> dict:
    """An OpenAI-shaped error, as the replicas' own (server/app.py)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code, **extra}}


def error(status: int, message: str, kind: str, code: str | None, **extra) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, code, **extra), status_code=status,
                        headers={"Retry-After": "1"} if status == 503 else None)


@dataclass
class SessionPlace:
    """Where a session lives, whose it is, and the newest data version the client was told of."""

    replica: str
    tenant: str | None
    version: int


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


@dataclass(frozen=True)
class RequestText:
    """What Ray's prefix router (--router prefix, baselines.py) matches: it reads a call argument
    with a `prompt` attribute. A completions `prompt` (a string, or parts whose `text` it joins) or
    a chat's `messages`, as the body holds them; other routes: their path."""

    prompt: object


def _text_of(call: tuple):
    """The prompt (or messages) of a call's JSON body, for Ray's prefix router; else its path."""
    try:
        body = json.loads(call[4]) if call[4] else {}
    except ValueError:
        body = {}
    text = body.get("prompt", body.get("messages")) if isinstance(body, dict) else None
    if isinstance(text, list) and text and not isinstance(text[0], str | dict):
        text = json.dumps(text)  # token ids: the router would read no text in them (and divide by it)
    return text if text else call[1]


async def _once(body: bytes):
    yield body


async def _body(stream) -> bytes | None:
    """A small answer's whole body (None: its replica died while sending it)."""
    try:
        return b"".join([chunk async for chunk in stream])
    except RayActorError:
        return None


def _auth(request: Request) -> list[tuple[bytes, bytes]]:
    """The client's Authorization header alone: what a call the ingress makes on its behalf carries."""
    return [(k, v) for k, v in request.headers.raw if k.lower() == b"authorization"]


@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, options: ServerOptions, model: str | None):
        self.replicas = replicas.options(method_name="forward", stream=True)
        self.hash_context = replicas.options(method_name="hash_context")
        self.options, self.model, self.tenants = options, model, options.tenants()
        self.sessions: dict[str, SessionPlace] = {}
        self.dead: set[str] = set()  # replicas seen dead: routed around until Serve drops them
        self._keys: RequestKeys | None = None
        self._keys_ready, self._keys_retry_at = asyncio.Lock(), 0.0

    @app.get("/metrics", include_in_schema=False)
    async def metrics(self, request: Request):
        """Every running replica's /metrics, labelled by replica, and the router's counts."""
        auth = _auth(request)
        ids = routing_state.replica_ids() or [None]  # (no router yet, before the first request: any one)
        texts = {}
        for rid in ids:  # one at a time: Serve routes a request's calls by its id, which they share
            answer = await self._send(("GET", "/metrics", b"", auth, b""), Routing(), rid)
            if answer is OWNER_GONE or isinstance(answer, JSONResponse):
                continue  # a replica gone since the router listed it: left out of this scrape
            head, stream = answer
            body = await _body(stream)
            if body is None:
                continue
            if head["status"] != 200:  # a missing or wrong key: the replica's own 401
                return _streamed(head["status"], head["headers"], _once(body), sse=False)
            texts[head["replica"]] = body.decode()
        return Response(cluster_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def forward(self, request: Request, path: str):
        body, path = await request.body(), request.url.path
        session = SESSION_PATH.fullmatch(path)
        tenant = self._tenant(request)
        place = self.sessions.get(session.group(1)) if session else None
        if place is not None and place.tenant != tenant:
            place = None  # another tenant's session: routed as unknown, answered 404 by a replica
        routing = await self._routing(path, body, tenant) if request.method == "POST" else Routing()
        call = (request.method, path, request.url.query.encode(), request.headers.raw, body)
        sent = await self._send(call, routing, place.replica if place else None)
        if sent is OWNER_GONE:
            sent = await self._take_over(session.group(1), place, request)
            if sent is None:
                sent = await self._send(call, routing, place.replica)
        if sent is OWNER_GONE:
            return error(503, *FAILED)
        if isinstance(sent, JSONResponse):
            return sent
        head, stream = sent
        headers = [(name, value) for name, value in head["headers"] if name.lower() != REPLICA_HEADER]
        headers.append((REPLICA_HEADER, head["replica"]))
        if session is not None or path == "/v1/sessions":
            if head["status"] == 200 and (place is not None or request.method == "POST"):
                return await self._session_answer(head, headers, stream, place, tenant)
        sse = any(name.lower() == "content-type" and value.startswith("text/event-stream") for name, value in headers)
        return _streamed(head["status"], headers, stream, sse)

    async def _send(self, call: tuple, routing: Routing, pin: str | None):
        """(head, stream) of a replica's answer; a 503 or 500 response; or OWNER_GONE when `pin`'s
        replica is dead or gone. A call whose replica dies before answering goes once more elsewhere."""
        for_router = (RequestText(_text_of(call)),) if self.options.router == "prefix" else ()
        for attempt in (1, 2):
            stream = self.replicas.remote(*call, *for_router, keys=routing.keys, pin=pin, avoid=sorted(self.dead),
                                          span_tokens=routing.span_tokens)
            try:
                head = await anext(stream)
            except asyncio.CancelledError:  # the client left before the answer began (Serve cancels us)
                stream.cancel()  # ... so the replica's request ends too
                raise
            except RayActorError as exc:  # the replica died before answering: nothing of it ran to the end
                log.warning("replica failed before answering %s %s: %s", call[0], call[1], exc)
                if pin is not None:
                    self.dead.add(pin)
                    return OWNER_GONE
                if attempt == 2:
                    return error(503, *FAILED)
                continue
            except Exception:  # noqa: BLE001 - not the client's doing: a 500 shaped as the replicas' own
                log.exception("forwarding %s %s failed", call[0], call[1])
                return error(500, *INTERNAL)
            if head.get("not_owner"):  # the pinned replica is no longer among the running ones
                self.dead.add(pin)
                return OWNER_GONE
            return head, stream

    async def _take_over(self, session_id: str, place: SessionPlace, request: Request):
        """Restore a session whose replica is gone on a live one, from its last save. None when the
        call may go on there (`place` then names it); otherwise the answer to give instead."""
        log.warning("session %s: its replica %s is gone; restoring it elsewhere", session_id, place.replica)
        if self.options.sessions is None:
            return error(410, f"session {session_id} was lost with its replica, and this server keeps no saved "
                         "sessions (--session-dir): create a new session", "invalid_request_error", "session_gone")
        sent = await self._send(("POST", f"/v1/sessions/{session_id}/restore", b"", _auth(request), b""), Routing(),
                               None)
        if sent is OWNER_GONE or isinstance(sent, JSONResponse):
            return sent
        head, stream = sent
        body = await _body(stream)
        if body is None:
            return error(503, *FAILED)
        if head["status"] == 404:
            return error(410, f"session {session_id} was lost with its replica before it was first saved: create "
                         "a new session", "invalid_request_error", "session_gone")
        if head["status"] != 200:  # (no room for it on the replica that took it: its own error)
            return _streamed(head["status"], head["headers"], _once(body), sse=False)
        version, told = json.loads(body)["version"], place.version
        place.replica, place.version = head["replica"], version
        log.warning("session %s restored on replica %s at data version %d", session_id, place.replica, version)
        if told > version:
            return error(409, f"session {session_id} was restored on another replica from its last save, at data "
                         f"version {version}; data versions {version + 1} to {told} were lost with its replica: "
                         "append them again", "invalid_request_error", "session_data_lost", version=version)
        return None

    async def _session_answer(self, head: dict, headers: list, stream, place: SessionPlace | None,
                              tenant: str | None):
        """A session's answer that moves what the ingress keeps (one opened, restored, closed, or
        given data): note it. These answers are small JSON; others stream on."""
        content_type = next((v for k, v in headers if k.lower() == "content-type"), "")
        if not content_type.startswith("application/json"):
            return _streamed(head["status"], headers, stream, sse=content_type.startswith("text/event-stream"))
        body = await _body(stream)
        if body is None:
            return error(503, *FAILED)
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        answer = answer if isinstance(answer, dict) else {}
        if answer.get("deleted"):
            self.sessions.pop(answer.get("id"), None)
        elif answer.get("object") in ("session", "session.data") and isinstance(answer.get("version"), int):
            if answer["object"] == "session":  # opened or restored (a GET answers this too: same place)
                self.sessions[answer["id"]] = SessionPlace(head["replica"], tenant, answer["version"])
            elif place is not None:
                place.version = max(place.version, answer["version"])
        return _streamed(head["status"], headers, _once(body), sse=False)

    def _tenant(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "").encode("latin-1")
        return self.tenants.tenant_of(auth) if self.tenants else None

    async def _routing(self, path: str, body: bytes, tenant: str | None) -> Routing:
        if self.options.router != "span" or len(body) > self.options.max_body_bytes:
            return Routing()  # (only ours reads keys)
        if path not in ("/v1/completions", "/v1/chat/completions", "/v1/spans"):
            return Routing()
        keys = await self._keys_of_engine()
        if keys is None:
            return Routing()
        # tokenizing a long prompt takes a while: off the event loop
        with routing_state.KEYS_SECONDS.time():
            return await asyncio.to_thread(keys, path, body, lambda client_salt: cache_salt(tenant, client_salt))

    async def _keys_of_engine(self) -> RequestKeys | None:
        """The hasher, made at the first request that needs it: the tokenizer, and the hash context
        a replica reports (None, and routing by load alone, while that fails)."""
        async with self._keys_ready:
            if self._keys is None and time.monotonic() >= self._keys_retry_at:
                try:
                    ctx = await self.hash_context.remote()
                    tokenizer = await asyncio.to_thread(lambda: load_tokenizer(resolve_model(self.model, False)))
                    ctx.check(tokenizer)
                    self._keys = RequestKeys(tokenizer, ctx)
                except Exception:  # noqa: BLE001 - routing degrades to load; requests still work
                    log.exception("no routing keys for %.0f s: requests are routed by load alone", KEYS_RETRY_S)
                    self._keys_retry_at = time.monotonic() + KEYS_RETRY_S
            return self._keys
