"""`spanserve serve` in a subprocess on a free port of 127.0.0.1: what the server tests and the
soak benchmark run against."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def metrics(url: str) -> dict[str, float]:
    """The server's unlabelled Prometheus samples, by name."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
            if name and not name.startswith("#") and "{" not in name}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m spanserve.cli serve ARGS` on a free port of 127.0.0.1; output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",  # OpenMP: the package's bounded spin
               "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "spanserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()
