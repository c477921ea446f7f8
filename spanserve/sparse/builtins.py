"""The built-in flows: block top-k, Quest, StreamingLLM and H2O, each a few lines over flow.py.

A request picks one set of blocks per layer for all its heads (our paged attention reads one block
table per sequence): per-head scores are summed over the query heads (Quest takes their maximum,
its bound being per head).
"""

import torch

from spanserve.kernels import cpu_kernel
from spanserve.sparse.flow import Flow, IndexerContext, select


class _Centroids(Flow):
    """The cache stage of flows that score blocks by their mean key."""

    def create_cache(self):
        return {"centroid": (-1,)}

    def forward_cache(self, keys, values):
        return {"centroid": keys.float().mean(1)}


class BlockTopK(_Centroids):
    """Blocks whose mean key (centroid) is closest to the query."""

    name = "block_topk"

    def forward_indexer(self, q, fields, state, ctx: IndexerContext):
        # the sum over query rows of q.centroid, as one matrix-vector product
        scores = fields["centroid"].flatten(1) @ q.float().sum(1).flatten()
        return select(scores, self, ctx)

    def pick_into(self, q, store, layer, block_ids, own, table, state, ctx: IndexerContext):
        """forward_indexer's picks in one C call over the centroids where they are (on CPU), into
        the block table: a layer's picks in tens of microseconds, not half a millisecond of small
        ops, after which the next kernel would also start slow (kernels/cpu_kernel.py's note on
        warm-up). A subclass's own indexer runs as written (None: pick_blocks)."""
        if type(self).forward_indexer is not BlockTopK.forward_indexer:
            return None
        return cpu_kernel.centroid_topk(store.layer_field(self, layer, "centroid"), block_ids, own, q,
                                        self.sink_blocks, self.recent_blocks, ctx.budget_blocks - 1, table)


class Quest(Flow):
    """Quest (Tang et al., 2024): an upper bound of q.k over a block from its keys' per-channel
    minimum and maximum."""

    name = "quest"

    def create_cache(self):
        return {"kmin": (-1,), "kmax": (-1,)}

    def forward_cache(self, keys, values):
        keys = keys.float()
        return {"kmin": keys.amin(1), "kmax": keys.amax(1)}

    def forward_indexer(self, q, fields, state, ctx: IndexerContext):
        # sum_d max(q_d kmin_d, q_d kmax_d): kmax where q_d > 0, kmin where q_d < 0, as two
        # batched matmuls per KV head instead of four [blocks, H, G, D] temporaries
        q = q.float().transpose(1, 2)  # [H, D, G]
        kmax, kmin = fields["kmax"].transpose(0, 1), fields["kmin"].transpose(0, 1)  # [H, B, D]
        bound = torch.baddbmm(torch.bmm(kmin, q.clamp(max=0)), kmax, q.clamp(min=0))  # [H, B, G]
        return select(bound.amax((0, 2)), self, ctx)


class StreamingLLM(Flow):
    """StreamingLLM (Xiao et al., 2023): attention sinks and a recent window, whatever the query."""

    name = "streaming"

    def forward_indexer(self, q, fields, state, ctx: IndexerContext):
        num, window = ctx.num_blocks, ctx.budget_blocks - 1 - self.sink_blocks
        recent = torch.arange(max(self.sink_blocks, num - window), num)
        return torch.cat([torch.arange(min(self.sink_blocks, num)), recent])


class H2O(_Centroids):
    """H2O (Zhang et al., 2023) on blocks: each step's attention over block centroids accumulates
    in the request's state; the heavy hitters (most accumulated weight) and the recent window stay."""

    name = "h2o"

    def forward_indexer(self, q, fields, state, ctx: IndexerContext):
        scale = q.shape[-1] ** -0.5
        weights = torch.einsum("hgd,bhd->hgb", q.float(), fields["centroid"]).mul(scale).softmax(-1).sum((0, 1))
        acc = state.get("acc")
        if acc is None or len(acc) > ctx.num_blocks:
            acc = torch.zeros(0, device=weights.device)
        acc = torch.cat([acc, torch.zeros(ctx.num_blocks - len(acc), device=weights.device)]) + weights
        state["acc"] = acc
        return select(acc, self, ctx)


BUILTINS: dict[str, type[Flow]] = {f.name: f for f in (BlockTopK, Quest, StreamingLLM, H2O)}
