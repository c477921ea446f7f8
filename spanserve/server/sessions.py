"""HTTP routes of streaming sessions (spanserve extension; sessions/session.py).

POST /v1/sessions, GET and DELETE /v1/sessions/{id}, POST /v1/sessions/{id}/data, POST
/v1/sessions/{id}/query (with stream), GET /v1/sessions/{id}/flash (server-sent events), POST
/v1/sessions/{id}/save and POST /v1/sessions/{id}/restore. A session belongs to the API key's tenant
that created it: any other caller gets the 404 of a session that does not exist.

Session state lives on the engine thread: every route reaches it through AsyncLLM.call. With a
session directory the server saves its open sessions there when it stops and opens them again
when it starts.
"""

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request

from spanserve.engine.async_engine import AsyncLLM
from spanserve.errors import InvalidRequestError, SessionNotFoundError, TooSoonError
from spanserve.server import openai_format as fmt
from spanserve.server.protocol import (
    SessionAnswer,
    SessionCreateRequest,
    SessionDataRequest,
    SessionInfo,
    SessionQueryRequest,
)
from spanserve.server.tenants import tenant_of
from spanserve.sessions import persist
from spanserve.sessions.disk import SessionDisk
from spanserve.sessions.session import SESSION_ID, Answer

log = logging.getLogger("spanserve.server")
SAVE_INTERVAL_S = 5.0  # POST .../save at most this often per session: a save copies all of its KV


def _file(disk: SessionDisk | None, session_id: str) -> Path:
    if disk is None:
        raise InvalidRequestError("this server keeps no sessions on disk (start it with --session-dir)")
    return disk.file(session_id)


def session_lifespan(llm: AsyncLLM, disk: SessionDisk | None):
    """Open the sessions saved on `disk` at start (unless it says not to), save them by its policy
    while serving, and save every open one at stop."""
    store = llm.engine.sessions

    def restore_all() -> None:
        for path in sorted(disk.directory.glob("sess-*.safetensors")):
            try:
                session = store.restore(path, tenant=persist.tenant_of(path))
                log.info("restored session %s (%d tokens)", session.id, len(session.state.tokens))
            except Exception as exc:  # noqa: BLE001 - a file that cannot be opened is refused, never fatal
                log.warning("session file %s not restored: %s", path, exc)

    def save_all() -> None:
        for session in list(store.sessions.values()):
            persist.save(session, disk.file(session.id))

    @asynccontextmanager
    async def lifespan(_app):
        saver = None
        if disk is not None:
            disk.directory.mkdir(parents=True, exist_ok=True)
            if disk.restore_at_start:
                await llm.call(restore_all)
            if disk.save != "stop":
                saver = asyncio.create_task(_save_by_policy(llm, disk))
        yield
        if saver is not None:
            saver.cancel()
        if disk is not None:
            await llm.call(save_all)

    return lifespan


async def _save_by_policy(llm: AsyncLLM, disk: SessionDisk) -> None:
    """Every `interval_s`: snapshot, on the engine's thread, each session whose data moved since its
    last save (sessions/disk.py, SAVE_POLICIES), then write the files off it."""
    store, saved = llm.engine.sessions, {}  # session id -> the version its file holds

    def due() -> list[tuple[str, persist.Snapshot]]:
        for gone in saved.keys() - store.sessions.keys():
            del saved[gone]
        snaps = []
        for session in store.sessions.values():
            st = session.state
            version = st.version if disk.save == "append" else st.visible_version
            if saved.get(session.id) != version and session.failure is None:
                saved[session.id] = version
                snaps.append((session.id, persist.snapshot(session)))
        return snaps

    while True:
        await asyncio.sleep(disk.interval_s)
        try:
            snaps = await llm.call(due)
            for session_id, snap in snaps:
                await asyncio.to_thread(persist.write, snap, disk.file(session_id))
            closed = await llm.call(lambda written=snaps: [sid for sid, _ in written if sid not in store.sessions])
            for session_id in closed:  # closed while its file was written: it must not come back
                disk.file(session_id).unlink(missing_ok=True)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed save (a full disk) is logged and tried again
            log.exception("saving sessions failed")
            saved.clear()


def add_session_routes(app: FastAPI, server, llm: AsyncLLM, disk: SessionDisk | None, *, errors: dict, sse,
                       final_output) -> None:
    """The routes, on `app`; `sse` and `final_output` are the server's (app.py)."""
    store = llm.engine.sessions
    vocab_size = llm.engine.model_config.vocab_size

    @app.post("/v1/sessions", responses=errors)
    async def create_session(body: SessionCreateRequest, http: Request) -> SessionInfo:
        server.check_model(body.model)
        tenant = tenant_of(http)
        return await llm.call(lambda: store.create(body.system, body.retention_tokens, body.flash, tenant,
                                                   body.flash_max_tokens, body.exit_answers,
                                                   body.exit_threshold).info())

    # One route for both methods: a 405 on this path then lists them both in its Allow header.
    @app.api_route("/v1/sessions/{session_id}", methods=["GET", "DELETE"], responses=errors)
    async def session(session_id: str, http: Request) -> dict:
        """GET: the session's state. DELETE: close it (and forget its saved file)."""
        tenant = tenant_of(http)
        if http.method == "GET":
            return await llm.call(lambda: store.get(session_id, tenant).info())
        await llm.call(lambda: store.close(session_id, tenant))
        if disk is not None and SESSION_ID.fullmatch(session_id):
            disk.file(session_id).unlink(missing_ok=True)  # it must not come back at restart
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/sessions/{session_id}/data", responses=errors)
    async def append_data(session_id: str, body: SessionDataRequest, http: Request) -> dict:
        """Queue data; returns at once with its version (computed in the background)."""
        tenant = tenant_of(http)

        def check():
            session = store.get(session_id, tenant)
            session.check_data_size(len(body.text))  # before it is tokenized
            return len(session.flash)

        flash_questions = await llm.call(check)
        if flash_questions:  # the questions it sets off queue like requests (--max-queued): room for them now
            server.check_room(flash_questions)
        tokens = await asyncio.to_thread(store.format.data, body.text)  # a long text: off the event loop
        version = await llm.call(lambda: store.get(session_id, tenant).append_tokens(tokens))
        return {"id": session_id, "object": "session.data", "version": version, "tokens": len(tokens)}

    @app.post("/v1/sessions/{session_id}/query", responses=errors)
    async def query_session(session_id: str, body: SessionQueryRequest, http: Request):
        server.check_model(body.model)
        tenant, params = tenant_of(http), body.sampling_params(body.max_tokens, None, vocab_size)
        request_id, seen = f"sq-{uuid.uuid4().hex[:24]}", {}

        def start():
            result = store.get(session_id, tenant).query(body.question, params, request_id)
            if isinstance(result, Answer):
                return result
            seen["version"] = result.version
            return result.group

        run = server.track(request_id, llm.submit_started(request_id, start))
        server.admit([run], 1)  # a question queues like any request (--max-queued)
        first = await anext(run)  # a bad question is a 4xx here, before any response starts
        if body.stream:
            return sse(_answer_chunks(first, run, seen, session_id, request_id))
        if isinstance(first, Answer):
            return _answer_body(request_id, session_id, first, "stop", None)
        final = first if first.finished else await final_output(run, http)
        c = final.outputs[0]
        return _answer_body(request_id, session_id, Answer(c.text, seen["version"]), c.finish_reason,
                            fmt.usage([final]))

    async def _answer_chunks(first, run, seen: dict, session_id: str, request_id: str):
        def chunk(text, finish_reason, version, kept: Answer | None = None):
            return {"id": request_id, "object": "session.answer.chunk", "created": int(time.time()),
                    "session_id": session_id, "version": version, "flash_hit": bool(kept and kept.flash_hit),
                    "speculative": bool(kept and kept.speculative),
                    "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}
        if isinstance(first, Answer):
            yield chunk(first.text, "stop", first.version, first)
            return
        sent, out = 0, first
        try:
            while True:
                c = out.outputs[0]
                if len(c.text) > sent or c.finish_reason:
                    yield chunk(c.text[sent:], c.finish_reason, seen["version"])
                    sent = len(c.text)
                if out.finished:
                    return
                out = await anext(run)
        finally:
            await run.aclose()  # a client gone mid-stream: the question is aborted at once

    @app.get("/v1/sessions/{session_id}/flash", responses=errors)
    async def flash_events(session_id: str, http: Request):
        """Server-sent events: each registered question's answer, now and after each ingest."""
        tenant, loop, queue = tenant_of(http), asyncio.get_running_loop(), asyncio.Queue()

        def push(event):
            loop.call_soon_threadsafe(queue.put_nowait, event)

        unsubscribe = await llm.call(lambda: store.get(session_id, tenant).subscribe(push))

        async def events():
            try:
                while (event := await queue.get()) is not None:
                    yield {"object": "session.flash", "session_id": session_id, **event}
            finally:
                unsubscribe()

        return sse(events())

    last_saved: dict[str, float] = {}  # session id -> when its last save was taken

    @app.post("/v1/sessions/{session_id}/save", responses=errors)
    async def save_session(session_id: str, http: Request) -> dict:
        """The session copied on the engine's thread between two steps, its file written off it."""
        tenant, path = tenant_of(http), _file(disk, session_id)

        def take():
            session = store.get(session_id, tenant)  # another tenant's id: the 404 of none
            now = time.monotonic()
            for stale in [sid for sid, at in last_saved.items() if now - at > SAVE_INTERVAL_S]:
                del last_saved[stale]  # (only the recent ones matter)
            wait = SAVE_INTERVAL_S - (now - last_saved.get(session_id, float("-inf")))
            if wait > 0:
                raise TooSoonError(f"session {session_id} was saved less than {SAVE_INTERVAL_S:g} s ago; "
                                   f"retry in {wait:.1f} s", retry_after=wait)
            last_saved[session_id] = time.monotonic()
            return persist.snapshot(session)

        snap = await llm.call(take)
        await asyncio.to_thread(persist.write, snap, path)
        return {"id": session_id, "object": "session", "saved": True}

    @app.post("/v1/sessions/{session_id}/restore", responses=errors)
    async def restore_session(session_id: str, http: Request) -> SessionInfo:
        """Open a session saved with .../save (by the same API key)."""
        tenant, path = tenant_of(http), _file(disk, session_id)
        if not path.exists():
            raise SessionNotFoundError(f"no saved session {session_id!r}")
        return await llm.call(lambda: store.restore(path, tenant).info())



def _answer_body(request_id, session_id, answer: Answer, finish_reason, usage) -> dict:
    return SessionAnswer(id=request_id, session_id=session_id, version=answer.version, flash_hit=answer.flash_hit,
                         speculative=answer.speculative, text=answer.text, finish_reason=finish_reason,
                         usage=usage).model_dump()
