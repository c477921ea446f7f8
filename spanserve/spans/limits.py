"""What a server lets one span query cost, checked on the whole (optimized) tree before any call
runs: a query that breaks a limit is a 400 with the numbers, not 5,000 queued calls that fail
when the last one finds its prompt too long."""

from dataclasses import dataclass

from spanserve.spans.ir import Fragment, Generate, Join, Message, Node, QueryError


@dataclass(frozen=True)
class QueryLimits:
    max_depth: int = 16  # nested joins and calls
    max_fanout: int = 256  # children of one join
    max_calls: int = 256  # engine requests of the whole query (a call with n counts n)

    def check(self, tree: Node, max_model_len: int, count_tokens) -> int:
        """Raise QueryError if `tree` breaks a limit; return its number of engine requests.
        count_tokens(text) -> int tokenizes a leaf's text."""
        # Checked on the optimized tree, whose nodes are not those of the request: errors say "$".
        calls, stack = 0, [(tree, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > self.max_depth:
                raise QueryError("$", f"the query nests deeper than {self.max_depth} levels")
            if isinstance(node, Join):
                if len(node.items) > self.max_fanout:
                    raise QueryError("$", f"a node has {len(node.items)} children; at most {self.max_fanout}")
                stack.extend((c, depth + 1) for c in node.items)
            elif isinstance(node, Generate):
                if node.max_tokens >= max_model_len:
                    raise QueryError("$", f"max_tokens {node.max_tokens} leaves no room for a prompt in this "
                                     f"model's {max_model_len} tokens")
                calls += node.n
                stack.append((node.input, depth + 1))
        if calls > self.max_calls:
            raise QueryError("$", f"the query makes {calls} model calls; at most {self.max_calls}")
        if isinstance(tree, Generate):
            need = prompt_tokens_at_most(tree.input, count_tokens) + tree.max_tokens
            if need > max_model_len:
                raise QueryError("$", f"the root call may need {need} tokens (its prompt's texts, each inner call's "
                                 f"outputs at max_tokens, and its own max_tokens {tree.max_tokens}); the model "
                                 f"takes {max_model_len}")
        return calls


def prompt_tokens_at_most(node: Node, count_tokens) -> int:
    """The tokens `node` can put into its caller's prompt, as a vLLM request's budget counts them:
    its texts, and each inner call's n outputs at max_tokens (chat headers and padding aside)."""
    if isinstance(node, (Message, Fragment)):
        return count_tokens(node.text)
    if isinstance(node, Generate):  # a caller reads an inner call's outputs (its input only where the query says)
        return node.max_tokens * node.n
    if isinstance(node, Join):
        return sum(prompt_tokens_at_most(c, count_tokens) for c in node.items)
    return 0
