"""SessionStore: the engine's open sessions, each visible only to the tenant that created it.

A session exists only once every limit of it has been checked and its first background work has
started; its later background work runs after each engine step, and a failure there ends that
session alone (Session.fail), never the step of everyone else."""

from functools import cached_property
from pathlib import Path

from spanserve.errors import CacheFullError, InvalidRequestError, InvalidSessionError, SessionNotFoundError
from spanserve.sampling import SamplingParams
from spanserve.sessions import persist
from spanserve.sessions.format import SessionFormat
from spanserve.sessions.ready import DEFAULT_THRESHOLD, ReadyExit
from spanserve.sessions.session import Session, SessionState

QUESTION_ROOM = 512  # positions a session leaves by default for a question and its answer
SESSION_POOL_SHARE = 0.9  # sessions together may hold at most this much of the KV pool
# (one tenant's sessions: EngineConfig.session_tenant_share of it)


class SessionStore:
    def __init__(self, engine):
        self.engine = engine
        self.sessions: dict[str, Session] = {}

    @cached_property
    def format(self) -> SessionFormat:
        return SessionFormat(self.engine.tokenizer, self.engine.config.block_size, self.engine.pad_token_id)

    def create(self, system: str = "You are a helpful assistant.", retention_tokens: int | None = None,
               flash: list[str] = (), tenant: str | None = None, flash_max_tokens: int = 64,
               exit_answers: list[str] = (), exit_threshold: float = DEFAULT_THRESHOLD) -> Session:
        """A new session whose regions 0-1 keep at most `retention_tokens` tokens (default: the
        model's length less QUESTION_ROOM, or a quarter of it). Its instructions are computed in the background.
        `exit_answers`: the fast answers of ready-position speculative exit (ready.py; none: off)."""
        if not isinstance(system, str):
            raise InvalidRequestError("system must be a string")
        ready_exit = ReadyExit.make(exit_answers, exit_threshold)
        if not isinstance(flash, (list, tuple)) or not all(isinstance(q, str) and q for q in flash):
            raise InvalidRequestError("flash must be a list of non-empty questions")
        frozen = self.format.frozen(system)
        max_len, bs = self.engine.max_model_len, self.engine.config.block_size
        retention = max_len - min(QUESTION_ROOM, max_len // 4) if retention_tokens is None else retention_tokens
        if not isinstance(retention, int) or isinstance(retention, bool):
            raise InvalidSessionError("retention_tokens must be an integer")
        if retention < len(frozen) + 4 * bs:
            raise InvalidSessionError(
                f"retention_tokens ({retention}) must exceed the session's instructions ({len(frozen)} tokens, "
                f"region 0) by at least four blocks of {bs} tokens of data")
        if retention + bs > max_len:
            raise InvalidSessionError(f"retention_tokens ({retention}) leaves no room for a question within "
                                      f"max_model_len {max_len}")
        self._reserve(retention, tenant)
        params = SamplingParams(temperature=0.0, max_tokens=flash_max_tokens)
        state = SessionState(tokens=[], num_frozen=len(frozen), pending=list(frozen), retention_tokens=retention,
                             appended=len(frozen))  # the instructions are version 0
        # (the Session checks that its flash questions and ready position fit when it is full)
        session = Session(self.engine, state, tenant, flash=list(flash), flash_params=params, ready_exit=ready_exit)
        return self._open(session)

    def _open(self, session: Session) -> Session:
        """Start a checked session's background work, then register it: a session whose start
        fails is closed, and never exists."""
        session.service()
        if session.failure is not None:
            session.close()
            raise InvalidSessionError(f"the session could not start: {session.failure}")
        self.sessions[session.id] = session
        return session

    def _reserve(self, retention_tokens: int, tenant: str | None) -> None:
        """Sessions must fit in the pool together, each with its whole retention, and a tenant's
        within its share. The message tells a tenant its own sessions' use, not the others'."""
        kv = self.engine.kv
        needed = kv.blocks_needed(retention_tokens)
        # what sessions may pin: their share, less the room of one request of the model's whole length
        # (a session-heavy neighbour cannot wedge the stateless requests out)
        ceiling = kv.pool.num_blocks - kv.blocks_needed(self.engine.max_model_len)

        def room(sessions, share: float) -> int:
            cap = min(int(share * kv.pool.num_blocks), ceiling)
            return cap - sum(kv.blocks_needed(s.state.retention_tokens) for s in sessions)

        if ceiling < needed:
            raise CacheFullError(f"a session keeping {retention_tokens} tokens needs {needed} KV blocks, and this "
                                 f"server's pool of {kv.pool.num_blocks} keeps {kv.pool.num_blocks - ceiling} for one "
                                 f"request of the model's whole length ({self.engine.max_model_len} tokens): lower "
                                 f"retention_tokens or give the server a larger pool (--num-blocks, "
                                 f"--kv-cache-memory-gb)")
        own = room([s for s in self.sessions.values() if s.tenant == tenant], self.engine.config.session_tenant_share)
        if needed > own:
            raise CacheFullError(f"a session keeping {retention_tokens} tokens needs {needed} KV blocks; your "
                                 f"sessions may hold {max(own, 0)} more (lower retention_tokens, close a session, or "
                                 f"raise kv_cache_memory_gb)")
        if needed > room(self.sessions.values(), SESSION_POOL_SHARE):
            raise CacheFullError(f"a session keeping {retention_tokens} tokens needs {needed} KV blocks, more than "
                                 f"the sessions' share of the KV pool has free now; retry later or lower "
                                 f"retention_tokens")

    def restore(self, path, tenant: str | None = None) -> Session:
        """Open a session saved by persist.save (only for the tenant that saved it: to any other, a
        file that is there reads like one that is not)."""
        if not Path(path).exists() or persist.tenant_of(path) != tenant:
            raise SessionNotFoundError(f"no saved session {Path(path).stem!r}")
        session, kv = persist.load(self.engine, path)
        if session.tenant != tenant:
            raise SessionNotFoundError(f"no saved session {Path(path).stem!r}")
        if session.id in self.sessions:
            raise InvalidRequestError(f"session {session.id} is already open")
        self._reserve(session.state.retention_tokens, tenant)
        persist.fill(session, kv)
        return self._open(session)

    def get(self, session_id: str, tenant: str | None = None) -> Session:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.tenant != tenant:  # another tenant's session does not exist
            raise SessionNotFoundError(f"no session {session_id!r}")
        return session

    def close(self, session_id: str, tenant: str | None = None) -> None:
        self.get(session_id, tenant).close()
        del self.sessions[session_id]

    def service(self) -> None:
        """After each engine step: every session's background work (one that raises fails that
        session alone: Session.service)."""
        for session in list(self.sessions.values()):
            session.service()
