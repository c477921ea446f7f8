"""Flow: a sparse attention algorithm for decode, written as for one request (papers/vortex-sparse-attention.txt).

A flow has two stages:
- cache: `create_cache` declares per-block fields (a name and a shape per KV head), and
  `forward_cache` computes them from a block's keys and values. They are computed once per full
  block and layer and kept in the paged pool beside K and V (fields.py), so a block shared by the
  prefix cache is summarized once for every request that reads it;
- indexer: at each decode step and layer, `forward_indexer` picks the blocks to attend to from the
  query and the fields of the request's full blocks. The engine then attends only over those, the
  block holding the newest token always included. With `sparse_prefill`, a short prefill chunk
  (a question after cached data) is picked for in one call, its queries read as more query heads.

Shapes, for one request at one layer (B full blocks before the step's queries, H kv heads, G query
heads per kv head times the step's queries, D head dim, S block size): q [H, G, D]; keys and values
of blocks [n, S, H, D]; each field [B, H, *shape], float32 (kept in the cache's dtype).
`forward_indexer` returns block indices in [0, B), at most `ctx.budget_blocks` of them. `state` is
the request's own dict for this layer, kept across its decode steps (H2O's accumulator lives there).
"""

from dataclasses import dataclass

import torch

from spanserve.errors import InvalidSparseError


@dataclass(frozen=True)
class IndexerContext:
    num_blocks: int  # full blocks before the newest token's block
    budget_blocks: int  # how many of them the flow may pick
    layer: int
    step: int  # decode steps of this request so far


class Flow:
    """Base class. `sink_blocks` and `recent_blocks` are always kept by the built-ins (select())."""

    name = "flow"
    sink_blocks = 1
    recent_blocks = 4

    def create_cache(self) -> dict[str, tuple[int, ...]]:
        """Field name -> shape per block and KV head (() for a scalar, (D,) for a vector: -1 stands
        for the head dim)."""
        return {}

    def forward_cache(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fields of blocks [n, S, H, D] -> {name: [n, H, *shape]}, each block's from its keys and
        values alone (the n blocks may come from several layers)."""
        return {}

    def forward_indexer(self, q: torch.Tensor, fields: dict[str, torch.Tensor], state: dict,
                        ctx: IndexerContext) -> torch.Tensor:
        raise NotImplementedError

    def pick_blocks(self, q: torch.Tensor, store, layer: int, block_ids: torch.Tensor, state: dict,
                    ctx: IndexerContext) -> torch.Tensor:
        """The engine's call at each step and layer: the fields of blocks `block_ids` read from
        `store` (fields.py, refreshed this step), then forward_indexer. A flow may read its fields
        in place instead, or offer pick_into (BlockTopK: one C call)."""
        return self.forward_indexer(q, store.read(self, layer, block_ids), state, ctx)

    def pick_into(self, q: torch.Tensor, store, layer: int, block_ids: torch.Tensor, own: torch.Tensor,
                  table: torch.Tensor, state: dict, ctx: IndexerContext) -> int | None:
        """What pick_blocks does, where a flow can do it in one call (BlockTopK: C on CPU): its
        picks written straight into `table` as block ids, in order, `own` (the blocks of the
        step's queries) after them; returns how many of `block_ids` it picked. q: the step's
        query rows as the model computes them, [T, heads, D]. None: not here, the engine calls
        pick_blocks. The engine checks the count only: the ids must be of `block_ids`, in order,
        as pick_blocks' picks are checked to be (an id from elsewhere reads keys not the
        sequence's own)."""
        return None

    def min_budget_blocks(self) -> int:
        """The fewest blocks a budget must allow: the sinks, the recent window and the newest block."""
        return self.sink_blocks + self.recent_blocks + 1

    def check_budget(self, budget_tokens: int, block_size: int) -> None:
        least = self.min_budget_blocks() * block_size
        if not isinstance(budget_tokens, int) or budget_tokens < least:
            raise InvalidSparseError(f"sparse_budget {budget_tokens!r} is smaller than flow {self.name!r} needs: "
                                      f"{least} tokens (sinks, recent window and the newest block)")


def select(scores: torch.Tensor, flow: Flow, ctx: IndexerContext) -> torch.Tensor:
    """The sinks, the recent window, and the best-scoring other blocks up to the budget, in order.
    `scores` [B]: one per block (higher is more relevant)."""
    num, device = ctx.num_blocks, scores.device
    sinks = min(flow.sink_blocks, num)
    recent = max(sinks, num - flow.recent_blocks)  # the window's first block
    room = min(ctx.budget_blocks - 1 - sinks - (num - recent), recent - sinks)  # the newest block takes one
    best = scores[sinks:recent].topk(max(room, 0)).indices.sort().values + sinks
    return torch.cat([torch.arange(sinks, device=device), best, torch.arange(recent, num, device=device)])
