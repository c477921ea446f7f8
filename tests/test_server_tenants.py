"""Tenants (issue 13): keys name tenants, and no cache entry crosses from one tenant to another:
not prefix blocks, not span blocks, not a span query's calls; cache_salt splits a tenant further;
/metrics needs a key unless --metrics-public; one tenant's sessions keep to its share of the pool."""

import httpx
import pytest
from server_utils import ServerProcess, assert_openai_error

from spanserve.errors import InvalidRequestError
from spanserve.server.tenants import Tenants, cache_salt

KEYS = {"alice": "key-a", "bob": "key-b"}
TEXT = " ".join(f"word{i}" for i in range(80))  # several full blocks
DOC = " ".join(f"fact{i} is {i * 7}" for i in range(30))


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.txt"
    keys.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    server = ServerProcess(["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "1024",
                            "--api-keys", str(keys), "--api-key", "shared-key",
                            "--session-tenant-share", "0.05"], root / "server.log")
    yield server
    server.stop()


def call(server, tenant: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEYS.get(tenant, tenant)}"})
    assert r.status_code == 200, r.text
    return r.json()


def cached(server, tenant: str, prompt: str, **extra) -> int:
    body = call(server, tenant, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra})
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prompt_cached_by_one_tenant_is_cold_for_another(server):
    assert cached(server, "alice", TEXT) == 0
    assert cached(server, "alice", TEXT) >= 64
    assert cached(server, "bob", TEXT) == 0  # alice's blocks are not bob's
    assert cached(server, "bob", TEXT) >= 64
    assert cached(server, "shared-key", TEXT) == 0  # --api-key is a tenant of its own


def test_cache_salt_splits_a_tenant(server):
    prompt = "salted " + TEXT
    assert cached(server, "alice", prompt) == 0
    assert cached(server, "alice", prompt, cache_salt="project-2") == 0
    assert cached(server, "alice", prompt, cache_salt="project-2") >= 64


def test_span_documents_are_not_shared_across_tenants(server):
    def chat(tenant: str, doc: str, question: str) -> int:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": doc, "span": True},
                                                          {"type": "text", "text": question}]}], "max_tokens": 1}
        return call(server, tenant, "/v1/chat/completions", body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    chat("alice", DOC, "What is fact3?")
    warm_alice = chat("alice", DOC, "What is fact9?")
    chat("bob", DOC.replace("fact", "thing"), "What is fact9?")  # bob's own chat prefix is now cached
    fresh_doc_bob = chat("bob", DOC.replace("fact", "item"), "What is fact9?")  # a document nobody sent
    probe_bob = chat("bob", DOC, "What is fact9?")  # alice's document, placed by bob
    assert probe_bob == fresh_doc_bob < warm_alice


def test_span_query_calls_are_not_shared_across_tenants(server):
    query = {"g": {"input": {"cross": [{"user": TEXT}, {"user": "Summarize."}]}, "max_tokens": 2}}
    call(server, "alice", "/v1/spans", {"query": query})
    again = call(server, "alice", "/v1/spans", {"query": query})["calls"][-1]["cached_tokens"]
    probe = call(server, "bob", "/v1/spans", {"query": query})["calls"][-1]["cached_tokens"]
    assert again >= 64 and probe < again


def test_one_tenant_cannot_take_the_room_of_the_others_sessions(server):
    """--session-tenant-share 0.05 of 1,024 blocks: 51 blocks per tenant, two sessions of the
    default retention (384 tokens, 24 blocks) each."""
    def create(tenant: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/sessions", json={"system": "Log."}, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})

    alice = [create("alice").json()["id"] for _ in range(2)]
    error = assert_openai_error(create("alice"), 400, "your sessions may hold 3 more")
    assert error["code"] == "cache_full"
    bob = create("bob")
    assert bob.status_code == 200, bob.text
    for tenant, ids in (("alice", alice), ("bob", [bob.json()["id"]])):
        for sid in ids:
            r = httpx.delete(f"{server.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEYS[tenant]}"})
            assert r.status_code == 200, r.text


def test_metrics_need_a_key(server):
    assert_openai_error(httpx.get(f"{server.url}/metrics", timeout=10), 401)
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer key-b"}, timeout=10)
    assert r.status_code == 200 and "spanserve" in r.text
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"},
                                   headers={"Authorization": "Bearer key-c"}), 401)


def test_keys_files_are_read_strictly(tmp_path):
    good = tmp_path / "keys"
    good.write_text("k1 alice  # comment\n\nk2 bob\n")
    tenants = Tenants.load("k0", str(good))
    assert tenants.tenant_of(b"Bearer k2") == "bob" and tenants.tenant_of(b"Bearer k0") == "default"
    assert tenants.tenant_of(b"Bearer k3") is None and tenants.tenant_of(b"k1") is None
    bad = tmp_path / "bad"
    bad.write_text("k1 alice extra\n")
    with pytest.raises(InvalidRequestError, match="bad:1: expected `KEY TENANT`"):
        Tenants.load(None, str(bad))
    with pytest.raises(InvalidRequestError, match="listed twice"):
        Tenants.load("k1", str(good))
    with pytest.raises(InvalidRequestError, match="cannot read"):
        Tenants.load(None, str(tmp_path / "missing"))
    assert Tenants.load() is None
    assert cache_salt(None, "s") == "s" and cache_salt("a", None) != cache_salt("b", None)
    assert cache_salt("a", "b c") != cache_salt("a b", "c")  # no two (tenant, salt) pairs collide


def test_tokenize_and_detokenize_need_a_key(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=10), 401)
        assert httpx.post(f"{server.url}{path}", json=body, timeout=10,
                          headers={"Authorization": "Bearer key-b"}).status_code == 200
