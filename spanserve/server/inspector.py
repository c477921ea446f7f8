"""The live cache inspector: `GET /inspect`, a page that shows what the KV cache holds for the
caller's tenant, kept current over server-sent events.

- the pool, block by block: free, cached (free, its KV kept for a hit) or in use, and what each of
  the tenant's blocks holds: a prefix, a span (a document, reusable at any position), a session;
  another tenant's blocks show only their state;
- the tenant's recent requests: prompt and cached tokens, spans and span tokens found cached,
  link policy, span tokens recomputed in context (a focus probe's or CacheBlend's relink), time to
  first token;
- the tenant's sessions: their regions, data versions and flash answers.

The engine tells the inspector of each request as it ends, its blocks still held (LLMEngine's
end_watchers): that is how a cached block keeps its owner after its request is gone. Everything
is read on the engine's thread (AsyncLLM.call), between steps. Routes sit behind the same API
keys as /v1/*; a browser may send the key as HTTP Basic credentials (server/app.py).
"""

import asyncio
import time
from collections import deque
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from spanserve.engine.async_engine import AsyncLLM
from spanserve.engine.request import Request as EngineRequest
from spanserve.server.tenants import tenant_of

RECENT = 200  # requests kept (all tenants); a page shows its tenant's newest 50
SHOWN = 50
EVERY_S = 1.0  # the page's refresh over SSE
_STATE_CODES = {"free": "f", "cached": "c", "in_use": "u"}  # one letter per block: a pool has thousands


class CacheInspector:
    def __init__(self, engine):
        self.engine = engine
        self.recent: deque[dict] = deque(maxlen=RECENT)
        self.owners: dict[int, tuple] = {}  # block id -> (tenant, kind, hash, request) of an ended request
        engine.end_watchers.append(self.request_ended)

    def request_ended(self, req: EngineRequest) -> None:
        """(Engine thread.) Note the request, and who owns the blocks it leaves cached."""
        self.recent.append(_request_info(req) | {"ended": time.time()})
        for i, block in enumerate(req.block_table):
            if block.block_hash is not None:
                self.owners[block.block_id] = (req.tenant, _kind(req, i), block.block_hash, req.group_id)

    def snapshot(self, tenant: str | None) -> dict:
        """(Engine thread.) What `tenant` may see of the cache now."""
        engine, pool = self.engine, self.engine.kv.pool
        marks = self._marks()
        blocks, counts = [], {"free": 0, "cached": 0, "in_use": 0}
        for block in pool.blocks:
            state = "in_use" if block.ref_cnt else "cached" if block.block_hash is not None else "free"
            counts[state] += 1
            owner = marks.get(block.block_id)
            mine = owner is not None and owner[0] == tenant and state != "free"
            blocks.append([_STATE_CODES[state], owner[1] if mine else None, owner[2] if mine else None])
        sched = engine.scheduler
        running = [_request_info(r) for r in (*sched.running, *sched.waiting) if r.tenant == tenant]
        ended = [r for r in reversed(self.recent) if r["tenant"] == tenant][:SHOWN]
        sessions = [_session_info(s) for s in engine.sessions.sessions.values() if s.tenant == tenant]
        return {"time": time.time(), "block_size": engine.config.block_size,
                "pool": {"blocks": pool.num_blocks, **counts}, "blocks": blocks,
                "running": [_public(r) for r in running], "recent": [_public(r) for r in ended],
                "sessions": sessions}

    def _marks(self) -> dict[int, tuple]:
        """Block id -> (tenant, kind, owner id): live requests and sessions, then ended requests'
        blocks that still hold what they left (a block given out again has lost its hash)."""
        pool, marks = self.engine.kv.pool, {}
        for block_id, (tenant, kind, block_hash, owner) in list(self.owners.items()):
            if pool.blocks[block_id].block_hash == block_hash:
                marks[block_id] = (tenant, kind, owner)
            else:
                del self.owners[block_id]
        sched = self.engine.scheduler
        for req in (*sched.running, *sched.waiting):
            for i, block in enumerate(req.block_table):
                marks[block.block_id] = (req.tenant, _kind(req, i), req.group_id)
        for session in self.engine.sessions.sessions.values():
            for block in session.blocks:
                marks[block.block_id] = (session.tenant, "session", session.id)
        return marks


def _kind(req: EngineRequest, index: int) -> str:
    """What block `index` of a request holds: a span's tokens, or a prefix (context) block."""
    at = req.layout.span_at_block
    return "span" if index < len(at) and at[index] >= 0 else "prefix"


def _request_info(req: EngineRequest) -> dict:
    layout = req.layout
    span_tokens = sum(s.end - s.start for s in layout.spans)
    independent = sum(int(layout.independent[s.start:s.end].sum()) for s in layout.spans)
    cached_spans = sum(min(until, s.end) - s.start for until, s in zip(req.span_cached_until, layout.spans))
    ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
    return {"id": req.group_id or req.request_id, "tenant": req.tenant, "kind": req.priority.name.lower(),
            "prompt_tokens": req.num_prompt_tokens, "cached_tokens": req.num_cached_tokens or 0,
            "spans": len(layout.spans), "span_tokens": span_tokens, "span_tokens_cached": max(cached_spans, 0),
            "link_policy": _link_label(layout.link) if layout.spans else None,
            "relinked_tokens": span_tokens - independent if layout.spans else 0,
            "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
            "output_tokens": req.num_output_tokens, "finish_reason": req.finish_reason}


def _link_label(link) -> str:
    """A link policy as the engine's log names it: comb+focus48t, none, gap32..."""
    focus = f"+focus{link.focus_tokens}t" if link.focus_tokens else f"+focus{link.focus_spans}s" \
        if link.focus_spans else ""
    return link.name + focus


def _public(info: dict) -> dict:
    return {k: v for k, v in info.items() if k != "tenant"}


def _session_info(session) -> dict:
    info = session.info()
    return {**{k: info[k] for k in ("id", "version", "visible_version", "num_tokens", "frozen_tokens",
                                    "pending_tokens", "evicted_tokens", "retention_tokens", "closed", "failed")},
            "blocks": len(session.blocks),
            "flash": [{"question": f.question, "version": f.version, "answer": f.answer}
                      for f in session.flash.values()]}


def add_inspector_routes(app: FastAPI, llm: AsyncLLM, sse) -> CacheInspector:
    """GET /inspect (the page), /inspect/state (one snapshot, JSON) and /inspect/events (a
    snapshot every EVERY_S, as server-sent events); `sse` is the server's (app.py)."""
    inspector = CacheInspector(llm.engine)
    page = resources.files("spanserve.server").joinpath("static/inspect.html").read_text()

    @app.get("/inspect", response_class=HTMLResponse, include_in_schema=False)
    async def inspect_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/inspect/state")
    async def inspect_state(http: Request) -> dict:
        """What the caller's tenant may see of the KV cache now (the inspector page's data)."""
        tenant = tenant_of(http)
        return await llm.call(lambda: inspector.snapshot(tenant))

    @app.get("/inspect/events", include_in_schema=False)  # the page's feed, endless: /inspect/state for scripts
    async def inspect_events(http: Request):
        """The same snapshot every second, as server-sent events, until the client leaves."""
        tenant = tenant_of(http)

        async def snapshots():
            while not await http.is_disconnected():
                yield await llm.call(lambda: inspector.snapshot(tenant))
                await asyncio.sleep(EVERY_S)

        return sse(snapshots())

    return inspector
