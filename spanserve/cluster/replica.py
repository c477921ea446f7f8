"""A replica: one engine and the single-process server's FastAPI app, answering forwarded requests.

The ingress sends each HTTP request (method, path, headers, body) to `forward`, which runs it
through the app in-process (asgi.py): every route, auth, tenant and limit is `spanserve serve`'s
own code. Every `request_routing_stats_period_s` Ray Serve calls `record_routing_stats`; what it
returns (load, free blocks, the keys of the blocks held) reaches the router (router.py) as the
replica's `routing_stats`.
"""

import asyncio
import threading
from contextlib import AsyncExitStack
from dataclasses import dataclass

from ray import serve

from spanserve.cluster.asgi import run_asgi
from spanserve.cluster.keys import HashContext, key
from spanserve.config import EngineConfig
from spanserve.engine.async_engine import AsyncLLM
from spanserve.engine.llm_engine import LLMEngine
from spanserve.models import loader
from spanserve.server.app import create_app
from spanserve.server.tenants import Tenants
from spanserve.sessions.disk import SessionDisk
from spanserve.spans.limits import QueryLimits

MAX_KEYS = 4096  # keys a replica publishes: ~70 kB of routing stats at most, every period


@dataclass(frozen=True)
class ServerOptions:
    """The `spanserve serve` flags that shape the app (each replica builds its own)."""

    model_name: str
    api_key: str | None = None
    api_keys: str | None = None  # a file every replica's node can read
    max_queued: int | None = None
    corpus: str | None = None
    max_body_bytes: int = 32 << 20
    query_limits: QueryLimits = QueryLimits()
    metrics_public: bool = False
    sessions: SessionDisk | None = None  # storage every replica reads; restore_at_start False
    router: str = "span"  # or a key of baselines.ROUTERS

    @classmethod
    def from_args(cls, args, sessions: SessionDisk | None = None) -> "ServerOptions":
        return cls(args.served_model_name or loader.model_name(args.model),
                   args.api_key, args.api_keys, args.max_queued, args.corpus, int(args.max_body_mb * (1 << 20)),
                   QueryLimits(args.max_query_depth, args.max_query_fanout, args.max_query_calls),
                   args.metrics_public, sessions, args.router)

    def tenants(self) -> Tenants | None:
        return Tenants.load(self.api_key, self.api_keys)


def routing_stats(engine, limit: int = MAX_KEYS) -> dict:
    """Load and cache contents of one engine; read on its thread, between steps. Blocks in use come
    first among the keys: they stay until their requests end, while free ones may be evicted."""
    sched, pool = engine.scheduler, engine.kv.pool
    held = [b for b in pool.blocks if b.block_hash is not None]
    held.sort(key=lambda b: b.ref_cnt == 0)
    return {"load": len(sched.running) + len(sched.waiting), "free_blocks": pool.num_free,
            "keys": [key(b.block_hash) for b in held[:limit]]}


class EngineReplica:
    async def __init__(self, config: EngineConfig, options: ServerOptions):
        # AsyncLLM builds the engine on its own thread and waits for it: off this replica's event loop
        self.llm = await asyncio.to_thread(AsyncLLM, lambda: LLMEngine(config))
        retriever = None
        if options.corpus:
            from spanserve.spans.retrieval import Retriever

            retriever = Retriever(options.corpus, confine=True)
        self.app = create_app(self.llm, options.model_name, max_queued=options.max_queued, retriever=retriever,
                              tenants=options.tenants(), max_body_bytes=options.max_body_bytes,
                              query_limits=options.query_limits, metrics_public=options.metrics_public,
                              session_dir=options.sessions)
        self._lifespan = AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        threading.Thread(target=self.llm.engine.grammars.warm, name="grammar-warmup", daemon=True).start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                      *for_router, keys: list[str] | None = None, pin: str | None = None,
                      avoid: list[str] | None = None, span_tokens: list | None = None):
        """The app's response: its head (with this replica's id), then its body in chunks. `keys`,
        `pin`, `avoid` and `for_router` (the prompt's text, for Ray's prefix router) are for the
        router (it reads them from the call's arguments); `span_tokens`, the ingress's token ids of
        the request's spans, spare the engine tokenizing them again. A call pinned to another
        replica reached this one because that one is gone: the head says so, and the ingress
        restores the session here first (ingress.py)."""
        if pin is not None and pin != self.replica_id:
            yield {"status": 0, "headers": [], "replica": self.replica_id, "not_owner": True}
            return
        if span_tokens:
            self.llm.engine.span_tokens.add(span_tokens)
        first = True
        async for item in run_asgi(self.app, method, path, query, headers, body):
            yield {**item, "replica": self.replica_id} if first else item
            first = False

    def hash_context(self) -> HashContext:
        return HashContext.of(self.llm.engine)

    async def record_routing_stats(self) -> dict:
        return await self.llm.call(lambda: routing_stats(self.llm.engine))

    async def __del__(self):
        """Serve's stop: saves the open sessions (the app's lifespan), then stops the engine. A
        replica stopped while it was still starting has neither yet."""
        if hasattr(self, "_lifespan"):
            await self._lifespan.aclose()
        if hasattr(self, "llm"):
            self.llm.shutdown()
