"""Saving a session to one file and opening it again, byte for byte.

A safetensors file: the KV of the session's blocks as one tensor [layers, 2, blocks, block_size,
kv_heads, head_dim] in the engine's dtype, and in its metadata the session's state (tokens,
regions, pending data, versions, flash questions and answers), its owner, and what the KV is only
valid for: the model's weights (their fingerprint), dtype, quantization and block size.
"""

import dataclasses
import json
import os
from collections import deque
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spanserve.comb.plugin import model_fingerprint
from spanserve.errors import CacheFullError, InvalidRequestError, InvalidSessionError, SessionNotFoundError
from spanserve.sampling import SamplingParams
from spanserve.sessions.ready import ReadyExit
from spanserve.sessions.session import SESSION_ID, Session, SessionState

FORMAT = "spanserve-session-1"


def kv_identity(engine) -> dict:
    """What a saved KV cache is only valid for."""
    if "session_identity" not in engine.derived:
        engine.derived["session_identity"] = {
            "model": model_fingerprint(engine.runner.model), "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.config.quantization, "block_size": engine.config.block_size,
            "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch.")}
    return engine.derived["session_identity"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A session as it was at one moment, held apart from the engine: what save() writes."""

    kv: torch.Tensor  # on the CPU, its own copy
    meta: dict


def snapshot(session: Session) -> Snapshot:
    """Copy what a save writes, on the engine's thread (the session changes between steps); the
    file is then written anywhere (write), so a large save does not stall the engine."""
    engine = session.engine
    ids = torch.tensor([b.block_id for b in session.blocks], dtype=torch.long, device=engine.device)
    kv = engine.runner.kv_cache[:, :, ids].cpu().contiguous()
    state = dataclasses.asdict(session.state) | {"version_ends": list(session.state.version_ends)}
    meta = {"format": FORMAT, **kv_identity(engine), "id": session.id, "tenant": session.tenant, "state": state,
            "flash": [[f.question, f.version, f.answer] for f in session.flash.values()],
            "flash_max_tokens": session.flash_params.max_tokens,
            "ready_exit": session.ready_exit.info() if session.ready_exit else None}
    return Snapshot(kv, meta)


def write(snap: Snapshot, path: str | Path) -> Path:
    """Write a snapshot to `path` (atomically: a crash leaves the old file or none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"kv": snap.kv}, str(tmp), metadata={"session": json.dumps(snap.meta)})
    os.replace(tmp, path)
    return path


def save(session: Session, path: str | Path) -> Path:
    """Write `session` to `path` (snapshot and write, on the calling thread)."""
    return write(snapshot(session), path)


def load(engine, path: str | Path) -> tuple[Session, torch.Tensor]:
    """A session read from `path`, without blocks yet, and its KV (fill() puts it in the pool)."""
    name = Path(path).name  # messages name the file, never the server's folders
    meta, kv = _read(path)
    identity = kv_identity(engine)
    wrong = [k for k in identity if meta.get(k) != identity[k]]
    if wrong:
        raise InvalidSessionError(f"{name} holds a session of another model or setup ({', '.join(wrong)} differ): "
                                  "its KV cache is only valid where it was computed")
    try:
        saved = meta["state"]
        state = SessionState(**{**saved, "version_ends": deque(map(tuple, saved["version_ends"]))})
        _check_state(state, engine.model_config.vocab_size, engine.max_model_len)
        flash = [(str(q), int(v), a if a is None else str(a)) for q, v, a in meta["flash"]]
        params = SamplingParams(temperature=0.0, max_tokens=int(meta["flash_max_tokens"]))
        ready_exit = _ready_exit(meta.get("ready_exit"))
    except (KeyError, TypeError, ValueError, AttributeError, InvalidRequestError) as exc:
        raise InvalidSessionError(f"{name} is not a valid session file ({exc})") from None
    if not isinstance(meta.get("id"), str) or not SESSION_ID.fullmatch(meta["id"]):
        raise InvalidSessionError(f"{name} is not a valid session file (its session id)")
    session = Session(engine, state, meta.get("tenant"), meta["id"], flash_params=params, ready_exit=ready_exit)
    cache = engine.runner.kv_cache
    expected = (*cache.shape[:2], session.num_blocks_held(), *cache.shape[3:])
    if tuple(kv.shape) != expected or kv.dtype != cache.dtype:
        raise InvalidSessionError(f"{name} is not a valid session file (its KV does not match its tokens)")
    for question, version, answer in flash:
        session.register(question)
        session.flash[question].version, session.flash[question].answer = version, answer
    return session, kv


def _check_state(state: SessionState, vocab_size: int, max_len: int) -> None:
    """A saved state's fields have their types and ranges: token ids in the vocabulary, counts that
    are non-negative integers, a retention within the model's length. (ValueError otherwise.)"""
    for field_name in ("tokens", "pending"):
        ids = getattr(state, field_name)
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{field_name} must be a list of token ids below {vocab_size}")
    for field_name in ("num_frozen", "retention_tokens", "appended", "evicted", "version", "visible_version"):
        value = getattr(state, field_name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{field_name} must be a non-negative integer")
    if not isinstance(state.ready, bool) or state.retention_tokens >= max_len or state.num_frozen > state.appended:
        raise ValueError("ready, retention_tokens or num_frozen out of range")
    if not all(len(end) == 2 and all(type(x) is int for x in end) for end in state.version_ends):
        raise ValueError("version_ends must be pairs of integers")


def _ready_exit(saved: dict | None) -> ReadyExit | None:
    """A saved session's speculative exit, with the assessment it had kept."""
    if saved is None:
        return None
    ready = ReadyExit.make(saved["answers"], saved["threshold"])
    ready.version, ready.token, ready.gap = int(saved["version"]), saved["token"], float(saved["gap"])
    return ready


def tenant_of(path: str | Path) -> str | None:
    """The tenant a saved session belongs to (None: the file is not a session)."""
    try:
        with safe_open(str(path), "pt") as f:
            return json.loads((f.metadata() or {}).get("session", "{}")).get("tenant")
    except (SafetensorError, OSError, ValueError, AttributeError):
        return None


def _read(path: str | Path) -> tuple[dict, torch.Tensor]:
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("session", "null"))
            kv = f.get_tensor("kv")
    except FileNotFoundError:
        raise SessionNotFoundError(f"no session file {Path(path).name}") from None
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise InvalidSessionError(f"{Path(path).name} is not a session file ({type(exc).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidSessionError(f"{Path(path).name} is not a {FORMAT} file")
    return meta, kv


def fill(session: Session, kv: torch.Tensor) -> None:
    """Allocate the session's blocks and copy its saved KV into them."""
    engine, count = session.engine, kv.shape[2]
    if count > engine.kv.pool.num_free:
        raise CacheFullError(f"the session needs {count} free KV blocks, the pool has {engine.kv.pool.num_free}")
    session.blocks = engine.kv.pool.allocate(count)
    ids = torch.tensor([b.block_id for b in session.blocks], dtype=torch.long, device=engine.device)
    engine.runner.kv_cache[:, :, ids] = kv.to(engine.device)
