"""Sessions over HTTP: create, data, query (plain and streamed), flash events, save and restore
across a restart, and one tenant never reaching another's session."""

import json
import time

import httpx
import pytest
from server_utils import ServerProcess, assert_openai_error

KEYS = {"alice": "key-a", "bob": "key-b"}
ROWS = "".join(f"t={i:03d}, sensor={'ABC'[i % 3]}, value={(37 * i) % 101}\n" for i in range(12))


def _start(model, root):
    keys = root / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    return ServerProcess(["--model", str(model), "--dtype", "float32", "--num-blocks", "512",
                          "--api-keys", str(keys), "--session-dir", str(root / "sessions")], root / "server.log")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions-server")


@pytest.fixture(scope="module")
def server(tiny_llama_path, root):
    server = _start(tiny_llama_path, root)
    yield server
    server.stop()


def request(server, tenant, method, path, body=None):
    return httpx.request(method, f"{server.url}{path}", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def ingested(server, tenant, session_id):
    """Wait until every appended row is visible to questions."""
    for _ in range(600):
        info = request(server, tenant, "GET", f"/v1/sessions/{session_id}").json()
        if info["visible_version"] == info["version"]:
            return info
        time.sleep(0.05)
    raise AssertionError(info)


QUESTION = {"question": "Which sensor reported 74?", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_data_then_questions_plain_and_streamed(server):
    r = request(server, "alice", "POST", "/v1/sessions", {"system": "Answer from the log.", "retention_tokens": 400})
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    r = request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ROWS})
    assert r.status_code == 200 and r.json()["version"] == 1
    assert ingested(server, "alice", sid)["num_tokens"] > 0
    answer = request(server, "alice", "POST", f"/v1/sessions/{sid}/query", QUESTION).json()
    assert answer["version"] == 1 and not answer["flash_hit"] and answer["usage"]["completion_tokens"] == 6
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/query", json={**QUESTION, "stream": True},
                      headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["version"] == 1


def test_another_tenant_sees_no_session(server):
    sid = request(server, "alice", "POST", "/v1/sessions", {"system": "Mine."}).json()["id"]
    for method, path, body in [("GET", "", None), ("POST", "/data", {"text": "x"}), ("POST", "/query", QUESTION),
                               ("POST", "/save", None), ("DELETE", "", None), ("GET", "/flash", None)]:
        assert_openai_error(request(server, "bob", method, f"/v1/sessions/{sid}{path}", body), 404, "no session")
    assert request(server, "alice", "GET", f"/v1/sessions/{sid}").status_code == 200
    request(server, "alice", "POST", f"/v1/sessions/{sid}/save")
    assert_openai_error(request(server, "bob", "POST", f"/v1/sessions/{sid}/restore"), 404)
    assert_openai_error(request(server, "bob", "POST", "/v1/sessions/..%2F..%2Fetc%2Fpasswd/restore"), 404)


def test_bad_input_is_a_clear_4xx(server):
    assert_openai_error(request(server, "alice", "GET", "/v1/sessions/sess-unknown"), 404)
    assert_openai_error(request(server, "alice", "POST", "/v1/sessions", {"retention_tokens": 3}), 400,
                        "must exceed the session's instructions")
    sid = request(server, "alice", "POST", "/v1/sessions", {}).json()["id"]
    assert_openai_error(request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ""}), 400)
    assert_openai_error(request(server, "alice", "POST", f"/v1/sessions/{sid}/query",
                                {"question": "why " * 600, "max_tokens": 8}), 400, "room")
    assert request(server, "alice", "DELETE", f"/v1/sessions/{sid}").json()["deleted"]
    assert_openai_error(request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": "x"}), 404)


def test_flash_answers_are_pushed(server):
    sid = request(server, "alice", "POST", "/v1/sessions",
                  {"system": "Log.", "flash": ["Which sensor is last?"], "flash_max_tokens": 3}).json()["id"]
    request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ROWS})
    with httpx.stream("GET", f"{server.url}/v1/sessions/{sid}/flash", timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['alice']}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["version"] == 1:
                    break
    assert event["question"] == "Which sensor is last?" and event["answer"]
    hit = request(server, "alice", "POST", f"/v1/sessions/{sid}/query",
                  {"question": "Which sensor is last?", "max_tokens": 3}).json()
    assert hit["flash_hit"] and hit["text"] == event["answer"]


def _assessed(server, sid):
    """Wait until the ready position of the latest data is assessed (speculative exit)."""
    for _ in range(600):
        info = ingested(server, "alice", sid)
        if info["ready_exit"]["version"] == info["version"]:
            return info["ready_exit"]
        time.sleep(0.05)
    raise AssertionError(info)


def test_ready_exit_answers_unread_when_confident(server):
    body = {"system": "Log.", "exit_answers": ["none-of-these"], "exit_threshold": 0}
    sid = request(server, "alice", "POST", "/v1/sessions", body).json()["id"]
    request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ROWS})
    token = _assessed(server, sid)["token"]
    assert not request(server, "alice", "POST", f"/v1/sessions/{sid}/query", QUESTION).json()["speculative"]
    sid = request(server, "alice", "POST", "/v1/sessions", {**body, "exit_answers": [token]}).json()["id"]
    request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ROWS})
    assert _assessed(server, sid)["token"] == token
    answer = request(server, "alice", "POST", f"/v1/sessions/{sid}/query", QUESTION).json()
    assert answer["speculative"] and answer["text"] == token and not answer["flash_hit"] and answer["usage"] is None
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/query", json={**QUESTION, "stream": True},
                      headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [(c["speculative"], c["choices"][0]["text"]) for c in chunks] == [(True, token)]
    for bad in ({"exit_threshold": -1}, {"exit_answers": [""]}, {"exit_answers": "Yes"}):
        assert_openai_error(request(server, "alice", "POST", "/v1/sessions", {**body, **bad}), 400)


def test_a_client_leaving_a_streamed_answer_leaves_nothing_running(server):
    from server_utils import wait_for_metrics

    sid = request(server, "alice", "POST", "/v1/sessions", {"system": "Log."}).json()["id"]
    request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ROWS})
    ingested(server, "alice", sid)
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/query", headers=headers, timeout=120,
                      json={"question": "Tell me everything.", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
        next(r.iter_lines())  # one chunk, then gone
    idle = wait_for_metrics(server.url, lambda m: m.get("spanserve_num_requests_running", 1) == 0, 30, headers)
    assert idle["spanserve_num_requests_running"] == 0


def test_sessions_outlive_a_restart(server, tiny_llama_path, root):
    sid = request(server, "alice", "POST", "/v1/sessions", {"system": "Kept."}).json()["id"]
    request(server, "alice", "POST", f"/v1/sessions/{sid}/data", {"text": ROWS})
    info = ingested(server, "alice", sid)
    before = request(server, "alice", "POST", f"/v1/sessions/{sid}/query", QUESTION).json()
    server.stop()  # saves every open session
    again = _start(tiny_llama_path, root)
    try:
        assert request(again, "alice", "GET", f"/v1/sessions/{sid}").json() == info
        after = request(again, "alice", "POST", f"/v1/sessions/{sid}/query", QUESTION).json()
        assert after["text"] == before["text"] and after["version"] == before["version"]
    finally:
        again.stop()
