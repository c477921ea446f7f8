"""The span query optimizer: rewrite rules applied to a fixed point.

A rule looks at one node and returns its replacement, or None when it does not apply. The
optimizer takes the first rule in its list that matches anywhere in the tree (children
before parents), applies it once, and starts over until no rule fires: desugaring comes
before simplification, which comes before the rules that reshape the tree. It records
which rules fired.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spanserve.spans.ir import Chat, Cross, Fragment, Generate, Join, Node, Plus, QueryError, Retrieve

Rule = Callable[[Node], Node | None]
Retriever = Callable[[str, str | None, int], list[Fragment]]


def desugar_chat(node: Node) -> Node | None:
    """chat(m1, m2, ...) -> g(cross(m1, m2, ...))"""
    if isinstance(node, Chat):
        return Generate(Cross(node.messages), **node.params)
    return None


def desugar_retrieve(retriever: Retriever) -> Rule:
    """retrieve(query) -> plus(fragment, ...): the retrieved passages commute."""

    def desugar_retrieve(node: Node) -> Node | None:
        if isinstance(node, Retrieve):
            return Plus(tuple(retriever(node.query, node.corpus, node.k)))
        return None

    return desugar_retrieve


def flatten_joins(node: Node) -> Node | None:
    """plus(a, plus(b, c)) -> plus(a, b, c), and the same for cross: both are associative."""
    if isinstance(node, Join) and any(type(c) is type(node) for c in node.items):
        items = []
        for child in node.items:
            items.extend(child.items if type(child) is type(node) else (child,))
        return node.with_children(tuple(items))
    return None


def unwrap_single_child(node: Node) -> Node | None:
    """cross(a) -> a. Not plus(a): its one child is still an independent, reusable span."""
    if isinstance(node, Cross) and len(node.items) == 1:
        return node.items[0]
    return None


def distribute_plus(node: Node) -> Node | None:
    """plus(g(x), ...) -> plus(cross(x, g(x)), ...): the outer call sees each inner call's
    output after the input that produced it, exactly the token sequence the inner call left in
    the KV cache, so that KV is a cache hit (the 'dual output paradox'). Not for a `bare` g."""
    def exposed(c):
        return isinstance(c, Generate) and not c.bare

    if isinstance(node, Plus) and any(exposed(c) for c in node.items):
        return Plus(tuple(Cross((c.input, c)) if exposed(c) else c for c in node.items))
    return None


def judge_tree(arity: int) -> Rule:
    """g(... plus(c1..cn) ...) with n > arity -> the same g over plus(g(... plus(c1..ck) ...), ...):
    a k-ary tree of judges, each attending to at most k candidates (attention locality). The
    inner judges are bare: the outer one reads their verdicts, not the candidates again."""

    def judge_tree(node: Node) -> Node | None:
        if not isinstance(node, Generate) or not isinstance(node.input, Cross):
            return None
        for i, part in enumerate(node.input.items):
            if isinstance(part, Plus) and len(part.items) > arity:
                groups = [Plus(part.items[j:j + arity]) for j in range(0, len(part.items), arity)]
                judges = tuple(replace(_with_item(node, i, group), bare=True) for group in groups)
                return _with_item(node, i, Plus(judges))
        return None

    return judge_tree


def _with_item(node: Generate, i: int, item: Node) -> Generate:
    items = node.input.items
    return replace(node, input=Cross(items[:i] + (item,) + items[i + 1:]))


def _no_retriever(query: str, corpus: str | None, k: int) -> list[Fragment]:
    raise QueryError("$", "this query retrieves, but no corpus is configured: pass a retriever "
                          "(spanserve query --corpus DIR, spanserve serve --corpus DIR)")


@dataclass
class Optimized:
    tree: Node
    fired: list[str] = field(default_factory=list)  # rule names, in the order they fired


def default_rules(retriever: Retriever | None = None, judge_arity: int | None = None) -> list[Rule]:
    rules = [desugar_chat, desugar_retrieve(retriever or _no_retriever), flatten_joins, unwrap_single_child]
    if judge_arity:
        rules.append(judge_tree(judge_arity))
    rules.append(distribute_plus)
    return rules


def optimize(tree: Node, rules: list[Rule] | None = None, max_steps: int = 10_000) -> Optimized:
    """Rewrite `tree` until no rule applies."""
    rules = default_rules() if rules is None else rules
    result = Optimized(tree)
    for _ in range(max_steps):
        rewritten = _rewrite_once(result.tree, rules, result.fired)
        if rewritten is None:
            return result
        result.tree = rewritten
    raise RuntimeError("span query optimizer did not converge")


def _rewrite_once(tree: Node, rules: list[Rule], fired: list[str]) -> Node | None:
    for rule in rules:
        new = _apply_somewhere(tree, rule)
        if new is not None:
            fired.append(rule.__name__)
            return new
    return None


def _apply_somewhere(node: Node, rule: Rule) -> Node | None:
    for i, child in enumerate(node.children):
        new = _apply_somewhere(child, rule)
        if new is not None:
            children = list(node.children)
            children[i] = new
            return node.with_children(tuple(children))
    return rule(node)
