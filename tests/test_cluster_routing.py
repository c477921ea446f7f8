"""The routing code on its own: the span router's ranking, the cluster's merged /metrics, and the
simulated cluster that `spanserve bench cluster` runs at 16-256 replicas (same ranking code)."""

import pytest

pytest.importorskip("ray")

from benchmarks.cluster_sim import ROUTERS, SimConfig, simulate  # noqa: E402
from benchmarks.cluster_trace import Call, SimRenderer, make_trace  # noqa: E402
from spanserve.cluster.metrics import cluster_metrics  # noqa: E402
from spanserve.cluster.router import ranked, score  # noqa: E402


def test_the_replica_holding_most_of_a_request_comes_first_unless_past_its_load_bound():
    assert ranked([0, 40, 10], [0, 0, 0], [0, 0, 0])[0] == 1
    assert ranked([0, 40, 10], [0, 3, 0], [0, 0, 0], load_weight=16)[0] == 2  # 40 - 48 < 10
    assert ranked([0, 40, 10], [0, 3, 0], [0, 0, 0])[0] == 1  # the default weight: 40 - 12 > 10
    # sent 6 of the last 9 requests: past 1.5 times the mean (with this one, ceil(1.5 * 10 / 3) = 5)
    assert ranked([0, 40, 10], [0, 0, 0], [1, 6, 2])[-1] == 1
    assert score(40, 2, 16) == 8


def test_ties_are_broken_at_random_not_by_position():
    firsts = {ranked([2, 2, 2, 2], [0, 0, 0, 0], [0, 0, 0, 0])[0] for _ in range(200)}
    assert firsts == {0, 1, 2, 3}


def test_cluster_metrics_label_each_replicas_series_and_keep_one_family():
    text = ('# HELP spanserve_kv_blocks_free KV blocks free\n# TYPE spanserve_kv_blocks_free gauge\n'
            'spanserve_kv_blocks_free 7.0\n'
            '# HELP spanserve_requests_total Requests\n# TYPE spanserve_requests_total counter\n'
            'spanserve_requests_total{status="ok"} 3.0\n')
    merged = cluster_metrics({"r1": text, 'r"2': text.replace("7.0", "9.0")}).decode()
    assert merged.count("# TYPE spanserve_kv_blocks_free gauge") == 1
    assert 'spanserve_kv_blocks_free{replica="r1"} 7.0' in merged
    assert 'spanserve_kv_blocks_free{replica="r\\"2"} 9.0' in merged  # escaped by prometheus-client
    assert 'spanserve_requests_total{replica="r1",status="ok"} 3.0' in merged
    assert "spanserve_replicas_reporting 2.0" in merged and "spanserve_routed_requests" in merged


def test_a_documents_keys_are_the_same_wherever_it_stands_and_differ_by_tenant():
    renderer = SimRenderer(doc_tokens=64)
    a, b = renderer.request(Call(0, docs=(1, 2, 3))), renderer.request(Call(0, docs=(3, 1, 2)))
    assert a.chains[1:] == [b.chains[2], b.chains[3], b.chains[1]] and len(a.chains[1]) == 4
    assert not set(renderer.request(Call(1, docs=(1, 2, 3))).all_keys) & set(a.all_keys)


@pytest.fixture(scope="module")
def small_trace():
    trace = make_trace(1500, docs=48, k=4, tenants=2, conversations=2, turns=4, chat_share=0.15, seed=3)
    return [SimRenderer(doc_tokens=128).request(c) for c in trace]


def test_the_simulated_span_router_computes_the_least_prefill_and_stays_balanced(small_trace):
    config = SimConfig(replicas=8, capacity=256)
    results = {router: simulate(small_trace, config, router) for router in ROUTERS}
    ours = results.pop("span")
    for router, other in results.items():
        assert ours["prefill_tokens"] < 0.7 * other["prefill_tokens"], (router, ours, other)
    assert ours["load_skew"] < 2.0 and results["prefix"]["load_skew"] > ours["load_skew"]
    again = simulate(small_trace, config, "span")  # seeded: the same replay gives the same figures
    assert again | {"choice_p99_ms": None} == ours | {"choice_p99_ms": None}  # (but for this machine's time)


def test_without_a_session_dir_a_session_lost_with_its_replica_is_410_gone():
    """The ingress's answer when no saves exist to restore from (the cluster tests run with them)."""
    import asyncio
    import json
    from types import SimpleNamespace

    from spanserve.cluster.ingress import Ingress, SessionPlace
    from spanserve.cluster.replica import ServerOptions

    class Handle:  # no replica is ever called on this path
        def options(self, **kwargs):
            return self

    written = Ingress.__mro__[1]  # the class as written, under Serve's ASGI wrapper
    ingress = written.__new__(written)
    written.__init__(ingress, Handle(), ServerOptions("m"), None)
    answer = asyncio.run(ingress._take_over("sess-1", SessionPlace("gone", None, 3),
                                            SimpleNamespace(headers=SimpleNamespace(raw=[]))))
    error = json.loads(answer.body)["error"]
    assert answer.status_code == 410 and error["code"] == "session_gone" and "--session-dir" in error["message"]


def test_a_replica_takes_the_ingress_span_ids_before_it_answers():
    import asyncio
    from types import SimpleNamespace

    from fastapi import FastAPI

    from spanserve.cluster.replica import EngineReplica
    from spanserve.pic.span_tokens import SpanTokens

    app, seen = FastAPI(), []
    memo = SpanTokens(tokenizer=None)  # a replica whose engine would fail to tokenize anything itself

    @app.post("/v1/completions")
    def complete():
        seen.append(memo.encode("doc"))
        return {}

    class Bare(EngineReplica):
        def __del__(self):  # (Serve awaits the real one at a stop; this one never started)
            pass

    replica = object.__new__(Bare)
    replica.llm, replica.app, replica.replica_id = SimpleNamespace(engine=SimpleNamespace(span_tokens=memo)), app, "r1"

    async def answer():
        return [item async for item in replica.forward("POST", "/v1/completions", b"", [], b"{}",
                                                        span_tokens=[("doc", False, [5, 6])])]

    head = asyncio.run(answer())[0]
    assert head["status"] == 200 and head["replica"] == "r1" and seen == [[5, 6]]
