"""Bulk execution: many span queries, ordered so that queries sharing fragments run close
together and find them still cached (the span query paper's greedy clustering)."""

import time
from dataclasses import dataclass

from spanserve.spans.ir import Fragment, Message, Node, Plus


def shared_units(tree: Node) -> frozenset[str]:
    """The texts a query can share with others: every leaf under a plus (a span's content)."""
    units: set[str] = set()

    def walk(node: Node, in_plus: bool) -> None:
        if isinstance(node, (Message, Fragment)) and in_plus:
            units.add(node.text)
        for child in node.children:
            walk(child, in_plus or isinstance(node, Plus))

    walk(tree, False)
    return frozenset(units)


def greedy_order(units) -> list[int]:
    """Visit order: start with the query sharing most with the others, then always take the
    unvisited query that shares the most units with the one just run (ties: input order)."""
    units = list(units)
    if not units:
        return []
    left = set(range(len(units)))
    first = max(left, key=lambda i: (sum(len(units[i] & units[j]) for j in left if j != i), -i))
    order = [first]
    left.remove(first)
    while left:
        last = units[order[-1]]
        best = max(left, key=lambda i: (len(units[i] & last), -i))
        order.append(best)
        left.remove(best)
    return order


@dataclass
class BulkReport:
    order: list[int]
    seconds: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_bulk(llm, trees: list[Node], order: list[int], judge_arity: int | None = None,
             retriever=None) -> tuple[BulkReport, list]:
    """Run the queries one after another in `order`; results come back in input order."""
    results: list = [None] * len(trees)
    start = time.perf_counter()
    for i in order:
        results[i] = llm.run_query(trees[i], judge_arity=judge_arity, retriever=retriever)
    seconds = time.perf_counter() - start
    calls = [c for r in results for c in r.calls]
    report = BulkReport(order, seconds, sum(c.prompt_tokens for c in calls), sum(c.cached_tokens for c in calls))
    return report, results
