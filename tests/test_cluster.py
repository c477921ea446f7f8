"""`spanserve serve --replicas`: two replicas of the tiny model on Ray Serve behind one address, the
span-aware router, sessions pinned to their replica, /metrics over both, and a replica killed
mid-service: its requests fail fast, its sessions come back on the other from their last save."""

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from spanserve import LLM, SamplingParams  # noqa: E402
from spanserve.cluster import launch  # noqa: E402
from spanserve.cluster.ingress import REPLICA_HEADER  # noqa: E402
from spanserve.cluster.keys import HashContext, RequestKeys  # noqa: E402
from spanserve.cluster.launch import ClusterError  # noqa: E402
from spanserve.cluster.replica import ServerOptions, routing_stats  # noqa: E402
from spanserve.config import EngineConfig  # noqa: E402
from spanserve.sessions.disk import SessionDisk  # noqa: E402

MODEL = "tiny"
TIMEOUT = 60  # no request may take longer: a failure is an answer, never a hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def offline(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32")


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def url(tiny_llama_path, session_dir):
    began = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray_s = time.monotonic() - began
    config = EngineConfig(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    sessions = SessionDisk(session_dir, "ingest", interval_s=0.2, restore_at_start=False)  # what --replicas sets
    address = launch.start(config, ServerOptions(MODEL, sessions=sessions), replicas=2, port=_free_port())
    print(f"\nray.init {ray_s:.1f} s; Serve, 2 replicas and the ingress running {time.monotonic() - began:.1f} s "
          "after start")
    yield address
    began = time.monotonic()
    launch.stop()
    print(f"\nshutdown {time.monotonic() - began:.1f} s")


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def _replica_actors() -> set[str]:
    prefix = f"SERVE_REPLICA::{launch.APP}#{launch.REPLICA_DEPLOYMENT}#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def _running_replicas() -> int:
    app = serve.status().applications[launch.APP]
    return app.deployments[launch.REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0)


def _docs(topic: str) -> list[str]:
    return [f"{topic} record {i}: " + " ".join(f"{topic}-{i}-{j}" for j in range(12)) for i in range(3)]


def _rag(url: str, docs: list[str], question: str) -> httpx.Response:
    parts = ["Answer from the documents.\n", *({"text": d, "span": True} for d in docs), question]
    return _post(url, "/v1/completions", {"model": MODEL, "prompt": parts, "max_tokens": 4, "temperature": 0})


def test_routing_keys_are_the_engines_own_block_hashes(offline):
    docs = _docs("harbour")
    parts = ["Answer from the documents.\n", *({"text": d, "span": True} for d in docs), "Who?"]
    offline.generate([parts[0], *(_span(d) for d in docs), parts[-1]], SamplingParams(temperature=0, max_tokens=1))
    engine = offline.engine
    routing = RequestKeys(engine.tokenizer, HashContext.of(engine))(
        "/v1/completions", json.dumps({"prompt": parts}).encode(), lambda salt: salt)
    keys = routing.keys
    assert len(keys) >= 6  # every span block (and the intro's, if a whole block)
    assert set(keys) <= set(routing_stats(engine)["keys"])
    other = RequestKeys(engine.tokenizer, HashContext.of(engine))(
        "/v1/completions", json.dumps({"prompt": parts}).encode(), lambda salt: "another tenant")
    assert not set(other.keys) & set(keys)
    # the span ids the ingress hands the replica are the engine's own tokens of each document
    assert [(text, ids) for text, _, ids in routing.span_tokens] == [
        (d, engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs]


def test_a_span_querys_keys_are_its_documents_blocks_wherever_its_calls_put_them(offline):
    docs = _docs("meadow")
    query = {"g": {"input": {"cross": [{"system": "Answer from the documents."},
                                       {"plus": [{"fragment": d} for d in docs]}, {"user": "Which?"}]},
                   "max_tokens": 1}}
    offline.run_query(query)
    engine = offline.engine
    hasher = RequestKeys(engine.tokenizer, HashContext.of(engine))
    keys = hasher("/v1/spans", json.dumps({"query": query}).encode(), lambda salt: salt).keys
    assert len(keys) >= 3 and set(keys) <= set(routing_stats(engine)["keys"])
    plus = {"plus": [{"fragment": d} for d in docs[::-1]]}
    reordered = {"g": {"input": {"cross": [{"user": "Which comes last?"}, plus]}, "max_tokens": 1}}
    assert set(hasher("/v1/spans", json.dumps({"query": reordered}).encode(), lambda salt: salt).keys) == set(keys)


def _span(text: str):
    from spanserve import Span

    return Span(text)


def test_models_completion_and_streamed_chat_match_the_single_engine(url, offline):
    models = httpx.get(url + "/v1/models", timeout=TIMEOUT)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    greedy = SamplingParams(temperature=0, max_tokens=12)
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                                       "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline.generate(["The capital of France is"], greedy)[0].outputs[0].text
    messages = [{"role": "user", "content": "Say hello."}]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if
                   json.loads(e)["choices"])
    assert text == offline.chat(messages, greedy)[0].outputs[0].text


def test_documents_in_a_new_order_go_where_they_are_cached(url):
    for topic in ("harbour", "orchard", "quarry"):  # each first placement is a coin toss between two
        docs = _docs(topic)
        first = _rag(url, docs, "Which record is first?")
        again = _rag(url, docs[::-1], "Which record is last?")
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.headers[REPLICA_HEADER] == first.headers[REPLICA_HEADER], topic
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_sessions_calls_all_reach_the_replica_that_holds_it(url):
    for _ in range(3):
        created = _post(url, "/v1/sessions", {"model": MODEL})
        assert created.status_code == 200, created.text
        sid, home = created.json()["id"], created.headers[REPLICA_HEADER]
        calls = [_post(url, f"/v1/sessions/{sid}/data", {"text": "pump 3 pressure 4.2 bar\n"}),
                 _post(url, f"/v1/sessions/{sid}/query", {"question": "Which pump?", "max_tokens": 4}),
                 httpx.get(f"{url}/v1/sessions/{sid}", timeout=TIMEOUT),
                 httpx.delete(f"{url}/v1/sessions/{sid}", timeout=TIMEOUT)]
        for call in calls:
            assert call.status_code == 200, call.text
            assert call.headers[REPLICA_HEADER] == home
        assert httpx.get(f"{url}/v1/sessions/{sid}", timeout=TIMEOUT).status_code == 404


def test_metrics_gather_every_replica_under_its_label_and_count_routing(url):
    from prometheus_client.parser import text_string_to_metric_families

    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "Count:", "max_tokens": 2}).status_code == 200
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert r.text.count("# TYPE spanserve_kv_blocks_free gauge") == 1  # one family, a series per replica
    free = {s.labels["replica"]: s.value for s in families["spanserve_kv_blocks_free"].samples}
    assert set(free) == _replica_actors() and all(v > 0 for v in free.values())
    assert families["spanserve_replicas_reporting"].samples[0].value == 2
    assert {s.labels["replica"] for s in families["spanserve_prefix_cache_hit_rate"].samples} == set(free)
    routed = [s for s in families["spanserve_routed_requests"].samples if s.name.endswith("_total")]
    assert routed and {s.labels["reason"] for s in routed} <= {"pinned", "cache", "load"}
    assert {s.labels["replica"] for s in routed} <= set(free)


def test_more_replicas_than_free_cpus_is_an_error_at_start(url, tiny_llama_path):
    config = EngineConfig(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    with pytest.raises(ClusterError, match="need 1 CPUs; Ray sees 0 free"):  # both CPUs hold a replica
        launch.start(config, ServerOptions(MODEL), replicas=1, port=_free_port())
    with pytest.raises(ClusterError, match="need 2 GPUs; Ray sees 0 free"):
        launch.start(config, ServerOptions(MODEL), replicas=2, port=_free_port(), replica_cpus=0.01, replica_gpus=1)
    with pytest.raises(ClusterError, match="--router must be span or one of round-robin, pow2, prefix"):
        launch.start(config, ServerOptions(MODEL, router="nearest"), replicas=1, port=_free_port())


def test_serve_without_replicas_never_imports_ray(tiny_llama_path):
    """The single-process server, up to uvicorn.run, in a fresh interpreter."""
    code = ("import sys, uvicorn; from spanserve.cli import main\n"
            "def run(app, **kwargs):\n"
            "    assert not [m for m in sys.modules if m.split('.')[0] == 'ray'], 'ray was imported'\n"
            "    print('served without ray')\n"
            "uvicorn.run = run\n"
            f"main(['serve', '--model', {str(tiny_llama_path)!r}, '--dtype', 'float32', '--num-blocks', '64'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "served without ray" in done.stdout, done.stderr[-2000:]


def test_killing_a_replica_fails_at_most_its_requests_and_a_replacement_comes(url):
    before = _replica_actors()
    assert len(before) == 2
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 400,
                 "ignore_eos": True, "temperature": 0, "stream": True}
    ended = {}

    def stream_until_the_end():
        with httpx.stream("POST", url + "/v1/chat/completions", json=long_chat, timeout=TIMEOUT) as s:
            ended["replica"] = s.headers.get(REPLICA_HEADER)
            ended["status"] = s.status_code
            ended["lines"] = list(s.iter_lines())

    reader = threading.Thread(target=stream_until_the_end)
    reader.start()
    while "replica" not in ended and reader.is_alive():
        time.sleep(0.01)
    victim = ended.get("replica") or sorted(before)[0]
    killed = time.monotonic()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{launch.APP}#{launch.REPLICA_DEPLOYMENT}#{victim}", namespace="serve"),
             no_restart=True)
    reader.join(TIMEOUT)
    assert not reader.is_alive()  # the stream in flight ended: cut with an error event, or done before the kill
    tail = "\n".join(ended["lines"][-3:])
    assert ended["status"] == 200 and ("replica_failed" in tail or "[DONE]" in tail), tail
    statuses = [_post(url, "/v1/completions", {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 4}).status_code
                for i in range(8)]
    assert set(statuses) <= {200, 503} and statuses[-4:] == [200] * 4, statuses
    while not (_replica_actors() - before) or _running_replicas() < 2:  # polled, not loaded: 2 cores start it
        assert time.monotonic() - killed < TIMEOUT, "no replacement replica"
        time.sleep(0.5)
    new, served = (_replica_actors() - before).pop(), []
    while new not in served:  # it takes requests once running (the first goes by a coin toss, then by load)
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": f"Again {len(served)}:", "max_tokens": 2})
        assert r.status_code == 200 and len(served) < 20, (r.text, served)
        served.append(r.headers[REPLICA_HEADER])
    print(f"\nreplacement serving {time.monotonic() - killed:.1f} s after the kill; statuses after it {statuses}; "
          f"the stream in flight ended with {tail[-80:]!r}")


def _saved_state(path) -> dict | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return json.loads(f.metadata()["session"])["state"]
    except Exception:  # noqa: BLE001 - not there yet, or being replaced
        return None


def _until(check, what: str):
    deadline = time.monotonic() + TIMEOUT
    while not (result := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return result


def test_a_dead_replicas_sessions_come_back_from_their_last_save(url, session_dir):
    question = {"question": "Which pump reads highest?", "max_tokens": 6, "temperature": 0}
    opened = []  # (id, replica): sessions until the first one's replica holds two and the other one
    while not opened or [h for _, h in opened].count(opened[0][1]) < 2 or len({h for _, h in opened}) < 2:
        assert len(opened) < 16, opened  # (each goes to either replica by a coin toss)
        r = _post(url, "/v1/sessions", {"model": MODEL, "system": "You watch pumps."})
        opened.append((r.json()["id"], r.headers[REPLICA_HEADER]))
    sid, home = opened[0]
    unsaved = next(s for s, h in opened[1:] if h == home)  # its file goes: as if it died before its first save
    survivor = next(s for s, h in opened if h != home)
    for row in ("pump 1 pressure 4.2 bar\n", "pump 2 pressure 5.1 bar\n"):
        assert _post(url, f"/v1/sessions/{sid}/data", {"text": row}).json()["version"] in (1, 2)
    _until(lambda: httpx.get(f"{url}/v1/sessions/{sid}").json()["visible_version"] == 2, "data not computed")
    before = _post(url, f"/v1/sessions/{sid}/query", question).json()["text"]
    other_before = _post(url, f"/v1/sessions/{survivor}/query", question).json()
    path = session_dir / f"{sid}.safetensors"
    _until(lambda: (_saved_state(path) or {}).get("visible_version") == 2, "version 2 not saved")
    kept = path.read_bytes()
    assert _post(url, f"/v1/sessions/{sid}/data", {"text": "pump 3 pressure 9.9 bar\n"}).json()["version"] == 3
    _until(lambda: (_saved_state(path) or {}).get("visible_version") == 3, "version 3 not saved")

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{launch.APP}#{launch.REPLICA_DEPLOYMENT}#{home}", namespace="serve"),
             no_restart=True)
    _until(lambda: home not in _replica_actors(), "the replica did not die")
    path.write_bytes(kept)  # the save of version 3 had not happened when it died
    (session_dir / f"{unsaved}.safetensors").unlink()

    lost = _post(url, f"/v1/sessions/{sid}/query", question)
    assert lost.status_code == 409 and lost.json()["error"]["code"] == "session_data_lost", lost.text
    assert lost.json()["error"]["version"] == 2 and "versions 3 to 3 were lost" in lost.json()["error"]["message"]
    again = _post(url, f"/v1/sessions/{sid}/query", question)
    assert again.status_code == 200 and again.headers[REPLICA_HEADER] != home, again.text
    assert again.json()["text"] == before and again.json()["version"] == 2  # greedily the same as before the kill
    info = httpx.get(f"{url}/v1/sessions/{sid}", timeout=TIMEOUT)
    assert info.status_code == 200 and info.headers[REPLICA_HEADER] == again.headers[REPLICA_HEADER]
    appended = _post(url, f"/v1/sessions/{sid}/data", {"text": "pump 3 pressure 9.9 bar\n"})
    assert appended.status_code == 200 and appended.json()["version"] == 3  # the client sends what was lost

    gone = httpx.get(f"{url}/v1/sessions/{unsaved}", timeout=TIMEOUT)
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "session_gone", gone.text
    other = _post(url, f"/v1/sessions/{survivor}/query", question)  # the other replica's session: untouched
    assert other.status_code == 200 and other.json() | {"id": None} == other_before | {"id": None}
    assert httpx.get(f"{url}/v1/sessions/not-a-session", timeout=TIMEOUT).status_code == 404


def test_replicas_that_cannot_load_their_model_fail_the_start_with_the_reason(url):
    """(Last: it takes the CPUs of the cluster above.)"""
    serve.delete(launch.APP)
    _until(lambda: ray.available_resources().get("CPU", 0) >= 1, "the replicas' CPUs were not freed")
    began = time.monotonic()
    with pytest.raises(ClusterError, match="replicas could not start: .*model '/nonexistent/model' not found"):
        launch.start(EngineConfig(model="/nonexistent/model"), ServerOptions(MODEL), replicas=1, port=_free_port(),
                     replica_cpus=0.01)
    assert time.monotonic() - began < TIMEOUT
