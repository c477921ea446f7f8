"""Span query IR: parser, printer, builder, and each optimizer rule on small trees."""

import pytest

from spanserve.spans.ir import (
    Cross,
    Fragment,
    Generate,
    Plus,
    QueryError,
    assistant,
    chat,
    cross,
    fragment,
    g,
    parse,
    plus,
    pretty,
    retrieve,
    system,
    to_json,
    user,
)
from spanserve.spans.optimizer import (
    default_rules,
    desugar_chat,
    desugar_retrieve,
    distribute_plus,
    flatten_joins,
    judge_tree,
    optimize,
    unwrap_single_child,
)

RAG = {"g": {"input": {"cross": [{"system": "Be brief."}, {"plus": [{"user": "doc A"}, {"user": "doc B"}]},
                                 {"user": "question"}]}, "max_tokens": 64}}


def test_parse_builds_the_tree_the_builder_builds():
    expected = g(cross(system("Be brief."), plus(user("doc A"), user("doc B")), user("question")), max_tokens=64)
    assert parse(RAG) == expected


@pytest.mark.parametrize("tree", [
    g(cross(system("s"), plus(user("a"), user("b")), user("q")), max_tokens=9, temperature=0.5, n=2, seed=3,
      stop=["\n"], bare=True),
    chat(system("s"), user("hi"), max_tokens=5),
    g(plus(retrieve("what?", k=3), fragment("f", source="a.md"), assistant("x"))),
])
def test_json_round_trip(tree):
    assert parse(to_json(tree)) == tree


@pytest.mark.parametrize("bad, path", [
    ({"g": {"input": {"cross": [{"user": "a"}, {"usr": "b"}]}}}, "$.g.input.cross[1]"),
    ({"g": {"input": {"plus": []}}}, "$.g.input.plus"),
    ({"g": {"max_tokens": 3}}, "$.g"),
    ({"g": {"input": {"user": "a"}, "max_tokens": 0}}, "$.g.max_tokens"),
    ({"g": {"input": {"user": "a"}, "temperature": "hot"}}, "$.g.temperature"),
    ({"g": {"input": {"user": 5}}}, "$.g.input.user"),
    ({"g": {"input": {"user": "a"}, "colour": 1}}, "$.g"),
    ({"user": "a", "system": "b"}, "$"),
    ({"retrieve": {"query": "q", "k": 0}}, "$.retrieve.k"),
    ({"chat": {"messages": []}}, "$.chat.messages"),
])
def test_parse_errors_name_the_bad_node(bad, path):
    with pytest.raises(QueryError) as err:
        parse(bad)
    assert err.value.path == path and str(err.value).startswith(path + ":")


def test_pretty_prints_an_indented_tree():
    assert pretty(parse(RAG)) == "\n".join([
        "g max_tokens=64",
        "  cross",
        "    system 'Be brief.'",
        "    plus",
        "      user 'doc A'",
        "      user 'doc B'",
        "    user 'question'",
    ])


# ---- rules --------------------------------------------------------------------------------------


def test_desugar_chat():
    assert desugar_chat(chat(system("s"), user("u"), max_tokens=7)) == g(cross(system("s"), user("u")), max_tokens=7)
    assert desugar_chat(user("u")) is None


def test_desugar_retrieve():
    def retriever(query, corpus, k):
        return [Fragment(f"{query}-{i}") for i in range(k)]

    rule = desugar_retrieve(retriever)
    assert rule(retrieve("q", k=2)) == plus(fragment("q-0"), fragment("q-1"))
    assert rule(user("q")) is None


def test_flatten_joins():
    assert flatten_joins(plus(user("a"), plus(user("b"), user("c")))) == plus(user("a"), user("b"), user("c"))
    assert flatten_joins(cross(cross(user("a")), user("b"))) == cross(user("a"), user("b"))
    assert flatten_joins(plus(cross(user("a")), user("b"))) is None  # different joins do not merge


def test_unwrap_single_child():
    assert unwrap_single_child(cross(user("a"))) == user("a")
    assert unwrap_single_child(plus(user("a"))) is None  # a single span is still a span
    assert unwrap_single_child(cross(user("a"), user("b"))) is None


def test_distribute_plus_shows_each_inner_call_after_its_input():
    inner = [g(user(f"write {i}")) for i in range(2)]
    assert distribute_plus(plus(*inner, user("c"))) == plus(*(cross(x.input, x) for x in inner), user("c"))
    assert distribute_plus(plus(user("a"))) is None
    assert distribute_plus(plus(g(user("x"), bare=True))) is None


def test_judge_tree_groups_candidates_under_bare_inner_judges():
    candidates = [user(f"c{i}") for i in range(5)]
    judge = g(cross(system("judge"), plus(*candidates), user("best?")))
    tree = judge_tree(2)(judge)
    inner = tree.input.items[1]
    assert isinstance(inner, Plus) and len(inner.items) == 3
    assert inner.items[0] == g(cross(system("judge"), plus(*candidates[:2]), user("best?")), bare=True)
    assert inner.items[2].input.items[1] == plus(candidates[4])  # a group of one stays a span
    assert judge_tree(8)(judge) is None


def test_optimize_runs_to_a_fixed_point_and_records_the_rules():
    generators = [g(user(f"idea {i}"), temperature=0.5) for i in range(4)]
    query = chat(system("judge"), plus(plus(*generators[:2]), plus(*generators[2:])), user("pick one"))
    result = optimize(query)
    assert result.tree == g(cross(system("judge"), plus(*(cross(x.input, x) for x in generators)), user("pick one")))
    assert result.fired == ["desugar_chat", "flatten_joins", "distribute_plus"]  # the rules' order
    assert optimize(result.tree).fired == []  # a fixed point


def test_optimize_with_a_judge_arity_builds_a_tree_of_judges():
    candidates = [g(user(f"idea {i}")) for i in range(8)]
    result = optimize(chat(system("judge"), plus(*candidates), user("pick")), default_rules(judge_arity=2))
    depth, node = 0, result.tree
    while isinstance(node, Generate):
        depth += 1
        group = node.input.items[1]
        assert isinstance(group, Plus) and len(group.items) <= 2
        node = group.items[0]
    assert depth == 3  # 8 candidates, 2 per judge: 4 judges, 2 judges, 1 judge
    assert isinstance(node, Cross) and node.items[1] == candidates[0]  # candidates still distributed
    assert "judge_tree" in result.fired
