"""The live cache inspector (`GET /inspect`): behind the API keys (a browser may send one as Basic
credentials), one tenant sees its own blocks, requests and sessions and nothing of another's, the
state streams over server-sent events, and the page renders a span request's blocks in headless
Chromium (skipped where playwright or Chromium is absent)."""

import base64
import json
import os
import shutil
import time

import httpx
import pytest
from server_utils import ServerProcess

KEYS = {"alice": "key-a", "bob": "key-b"}
DOCS = [" ".join(f"{topic}{i} is {i * 3}" for i in range(20)) for topic in ("tide", "grain")]


def _auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("inspector")
    keys = root / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "256",
                            "--api-keys", str(keys)], root / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def activity(server):
    """alice: a request over two documents, then the same documents in the other order; bob: a
    plain request and a session."""
    ids = {}
    for name, docs in (("first", DOCS), ("reordered", DOCS[::-1])):
        parts = ["Read these.\n", *({"text": d, "span": True} for d in docs), "Which is larger?"]
        r = httpx.post(f"{server.url}/v1/completions", headers=_auth("alice"), timeout=60,
                       json={"prompt": parts, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        ids[name] = r.json()["id"]
        assert _state(server, "alice")["recent"][0]["id"] == ids[name]  # listed under the response's id
    r = httpx.post(f"{server.url}/v1/completions", headers=_auth("bob"), timeout=60,
                   json={"prompt": "Bob asks something plain.", "max_tokens": 2})
    assert r.status_code == 200, r.text
    ids["bob"] = r.json()["id"]
    session = httpx.post(f"{server.url}/v1/sessions", headers=_auth("bob"), timeout=60,
                         json={"system": "Bob's log of the pumps. " * 8, "flash": ["Anything new?"]}).json()
    ids["session"] = session["id"]
    for _ in range(600):  # its instructions computed
        if httpx.get(f"{server.url}/v1/sessions/{session['id']}", headers=_auth("bob")).json()["pending_tokens"] == 0:
            break
        time.sleep(0.05)
    assert len(set(ids.values())) == 4
    return ids


def _state(server, tenant: str) -> dict:
    r = httpx.get(f"{server.url}/inspect/state", headers=_auth(tenant), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_inspector_needs_a_key_and_takes_one_as_basic_credentials(server):
    for path in ("/inspect", "/inspect/state", "/inspect/events"):
        r = httpx.get(server.url + path, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert r.headers["www-authenticate"].startswith("Basic")
    wrong = base64.b64encode(b"anyone:not-a-key").decode()
    assert httpx.get(server.url + "/inspect", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    basic = base64.b64encode(f"alice:{KEYS['alice']}".encode()).decode()
    page = httpx.get(server.url + "/inspect", headers={"Authorization": f"Basic {basic}"}, timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "EventSource" in page.text


def test_a_tenant_sees_its_span_blocks_and_requests_and_nothing_of_anothers(server, activity):
    alice, bob = _state(server, "alice"), _state(server, "bob")
    for state in (alice, bob):
        pool, codes = state["pool"], [code for code, _, _ in state["blocks"]]
        assert len(codes) == pool["blocks"] == 256 == pool["free"] + pool["cached"] + pool["in_use"]
        assert (codes.count("f"), codes.count("c"), codes.count("u")) == (pool["free"], pool["cached"], pool["in_use"])
    kinds = [kind for _, kind, _ in alice["blocks"]]
    assert kinds.count("span") >= 8  # both documents' blocks
    owners = {owner for _, kind, owner in alice["blocks"] if kind == "span"}
    assert owners <= {activity["first"], activity["reordered"]}
    recent = {r["id"]: r for r in alice["recent"]}
    assert set(recent) == {activity["first"], activity["reordered"]}  # and not bob's
    first, again = recent[activity["first"]], recent[activity["reordered"]]
    assert first["spans"] == again["spans"] == 2 and first["link_policy"] == again["link_policy"]
    assert again["span_tokens_cached"] == again["span_tokens"] > first["span_tokens_cached"]  # reused
    assert again["cached_tokens"] > 0 and again["ttft_ms"] > 0 and again["prompt_tokens"] > 100
    assert alice["sessions"] == []

    assert {r["id"] for r in bob["recent"] if r["kind"] == "stateless"} == {activity["bob"]}
    assert not {kind for _, kind, _ in bob["blocks"]} & {"span"}
    assert activity["first"] not in json.dumps(bob) and activity["session"] not in json.dumps(alice)
    (session,) = bob["sessions"]
    assert session["id"] == activity["session"] and session["blocks"] > 0
    assert [f["question"] for f in session["flash"]] == ["Anything new?"]
    assert any(kind == "session" for _, kind, _ in bob["blocks"])


def test_the_state_streams_as_server_sent_events(server, activity):
    with httpx.stream("GET", f"{server.url}/inspect/events", headers=_auth("alice"), timeout=60) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 2:
                break
    assert all(e["pool"]["blocks"] == 256 for e in events) and events[1]["time"] > events[0]["time"]
    assert {r["id"] for r in events[1]["recent"]} == {activity["first"], activity["reordered"]}


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_the_page_renders_a_span_requests_blocks_in_chromium(server, activity):
    playwright = pytest.importorskip("playwright.sync_api")
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (Debian: apt install chromium)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(extra_http_headers=_auth("alice"), viewport={"width": 1200, "height": 900})
            page.goto(server.url + "/inspect")
            page.wait_for_selector("body[data-updates]", timeout=30_000)
            assert page.locator("#blocks .b.span").count() >= 4
            assert page.locator(f'tr[data-request="{activity["reordered"]}"]').count() == 1
            assert page.locator(f'tr[data-request="{activity["bob"]}"]').count() == 0
            if os.environ.get("SPANSERVE_INSPECTOR_SCREENSHOT"):  # how docs/inspector.png is made
                page.screenshot(path=os.environ["SPANSERVE_INSPECTOR_SCREENSHOT"], full_page=True)
        finally:
            browser.close()
