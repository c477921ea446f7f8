"""Where a server keeps its sessions' files, and what saves them besides a stop (`--session-dir`,
`--session-save`). The saving itself is persist.py's; the server's routes and lifespan use this
(server/sessions.py)."""

from dataclasses import dataclass
from pathlib import Path

from spanserve.errors import SessionNotFoundError
from spanserve.sessions.session import SESSION_ID

SAVE_POLICIES = {  # what, besides a stop and POST .../save, saves a session
    "stop": "nothing else",
    "ingest": "its data computed (a new visible version)",
    "append": "data queued (a new version), before it is computed",
}


@dataclass(frozen=True)
class SessionDisk:
    """Where sessions are saved, and when (`--session-dir`, `--session-save`)."""

    directory: Path
    save: str = "stop"  # a key of SAVE_POLICIES
    interval_s: float = 1.0  # one session's policy saves at most this often
    restore_at_start: bool = True  # a cluster's replica restores a session only when asked to

    def __post_init__(self):
        if self.save not in SAVE_POLICIES:
            raise ValueError(f"session save policy must be one of {', '.join(SAVE_POLICIES)}, not {self.save!r}")
        if self.interval_s <= 0:
            raise ValueError("the session save interval must be above 0 s")

    def file(self, session_id: str) -> Path:
        if not SESSION_ID.fullmatch(session_id):
            raise SessionNotFoundError(f"no session {session_id!r}")
        return self.directory / f"{session_id}.safetensors"
