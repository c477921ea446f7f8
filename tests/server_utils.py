"""Run `spanserve serve` as a real subprocess for the server tests (benchmarks/server_process.py), and
read what it exposes."""

import time

import httpx

from benchmarks.server_process import ServerProcess

__all__ = ["ServerProcess", "assert_openai_error", "metrics", "parse_metrics", "wait_for_metrics"]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; every line must be a comment or a sample."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert not line or line.startswith(("# TYPE ", "# HELP ")), line
            continue
        name, _, value = line.rpartition(" ")
        assert name and " " not in name.split("{")[0], line
        samples[name] = float(value)
    return samples


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=10, headers=headers)
    r.raise_for_status()
    return parse_metrics(r.text)


def wait_for_metrics(url: str, predicate, timeout: float, headers: dict | None = None) -> dict[str, float]:
    """Poll /metrics until predicate(samples) holds; return the last samples either way."""
    deadline = time.monotonic() + timeout
    while True:
        samples = metrics(url, headers)
        if predicate(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int, message_contains: str = "") -> dict:
    """The response has `status` and an OpenAI-shaped error body; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    assert message_contains.lower() in error["message"].lower(), error
    return error
