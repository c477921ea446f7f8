"""Bulk span queries: greedy clustering of shared fragments, and its effect on a small cache."""

from helpers import assert_engine_idle

from spanserve import LLM
from spanserve.spans.api import prepare
from spanserve.spans.bulk import greedy_order, run_bulk, shared_units
from spanserve.spans.ir import cross, g, plus, system, user


def test_shared_units_are_the_leaves_under_plus():
    tree = g(cross(system("s"), plus(user("a"), cross(user("b"), user("c"))), user("q")))
    assert shared_units(tree) == {"a", "b", "c"}


def test_greedy_order_keeps_queries_with_common_fragments_together():
    units = [frozenset("ab"), frozenset("cd"), frozenset("ef"), frozenset("ab"), frozenset("cd"), frozenset("ef")]
    order = greedy_order(units)
    assert sorted(order) == list(range(6))
    assert all(units[order[i]] == units[order[i + 1]] for i in (0, 2, 4))


def test_clustered_order_hits_more_on_a_small_cache(tiny_llama_path):
    words = "harbor mill bridge lighthouse market river tower garden".split()
    docs = {k: [" ".join(f"{w}{k}{i}" for w in words * 6) for i in range(2)] for k in "ABC"}
    trees = [prepare(g(cross(system("Answer."), plus(*map(user, docs[k])), user(f"question {n}")), max_tokens=2)).tree
             for n, k in enumerate("ABCABC")]
    units = [shared_units(t) for t in trees]
    reports, texts = {}, {}
    for name, order in (("given", list(range(6))), ("greedy", greedy_order(units))):
        llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=40)  # room for about one group
        reports[name], results = run_bulk(llm, trees, order)
        texts[name] = [r.text for r in results]
        assert_engine_idle(llm)
    assert texts["greedy"] == texts["given"]  # the order changes what is cached, never an answer
    assert reports["greedy"].prompt_tokens == reports["given"].prompt_tokens
    assert reports["greedy"].hit_rate > reports["given"].hit_rate, reports


def test_cli_bulk_reports_both_orders(tiny_llama_path, tmp_path, capsys):
    import json

    from spanserve.cli import main
    from spanserve.spans.ir import to_json

    queries = tmp_path / "queries.jsonl"
    trees = [g(cross(plus(user(f"doc {k} " * 20)), user(f"q{n}")), max_tokens=2) for n, k in enumerate("ABAB")]
    queries.write_text("".join(json.dumps(to_json(t)) + "\n" for t in trees))
    main(["query", str(queries), "--bulk", "--json", "--model", str(tiny_llama_path), "--dtype", "float32",
          "--num-blocks", "64"])
    out, err = capsys.readouterr()
    assert "given order" in err and "clustered order" in err
    assert [len(json.loads(line)["calls"]) for line in out.splitlines()] == [1, 1, 1, 1]
