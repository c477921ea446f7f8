"""FieldStore: the flows' per-block fields, in the paged pool beside K and V.

One tensor per (cache stage, field) of shape [layers, num_blocks, kv_heads, *shape], indexed by block id,
filled (at every layer, once per step: refresh) when a request's flow first needs a full block's
fields and kept while the block holds the same keys: the pool counts each block's rewrites
(BlockPool.generation: a new allocation, a session moving its keys), and a field computed under
an older count is computed again. A block shared by the prefix cache is therefore summarized
once for every request reading it.

Span blocks: their keys sit where the span was computed. A request decoding over moved span keys
does so over private copies rotated to its positions (engine span_key_copies), whose fields are
computed from the moved keys; a request still reading the shared blocks rotated at each step
decodes with full attention (sparse.py).

Flows that share a cache stage (the same forward_cache and fields, e.g. block_topk and h2o's
centroids) share its fields: a block is summarized once for both.
"""

import torch

# The most blocks (layers x blocks) one forward_cache call gets: a session's first question
# refreshes thousands of blocks, whose keys and values are copied out for the call.
REFRESH_BLOCKS = 1024


class FieldStore:
    def __init__(self, kv_cache: torch.Tensor, generation: torch.Tensor):
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.generation = generation  # [num_blocks] the pool's per-block rewrite counts (CPU)
        self.fields: dict[tuple, dict[str, torch.Tensor]] = {}  # stage -> field name -> tensor
        self.computed: dict[tuple, torch.Tensor] = {}  # stage -> [layers, num_blocks] generation, -1: none

    def refresh(self, flow, block_ids: torch.Tensor) -> None:
        """Compute `flow`'s missing or stale fields of blocks `block_ids` at every layer. A step
        refreshes a sequence's blocks once for all its layers: the blocks before its queries are
        not rewritten while it runs, and one check costs what thirty did. The blocks stale at any
        layer are computed at every layer in one forward_cache call (a field is a function of its
        block alone): a block is new or rewritten at all layers at once."""
        specs = flow.create_cache()
        if not specs:
            return
        stage = self._stage(flow, specs)
        ids, computed, fields = block_ids.cpu(), self.computed[stage], self.fields[stage]
        # index_select: a few times faster than advanced indexing on CPU
        stale = (computed.index_select(1, ids) != self.generation.index_select(0, ids)).any(0)
        if not stale.any():
            return
        todo = ids[stale]
        on_device, per_call = todo.to(block_ids.device), max(1, REFRESH_BLOCKS // len(todo))
        for first in range(0, self.kv_cache.shape[0], per_call):
            layers = slice(first, first + per_call)
            # (not index_select, which copies the whole pool out of this strided view first)
            keys, values = (self.kv_cache[layers, i, on_device].flatten(0, 1) for i in (0, 1))
            for name, value in flow.forward_cache(keys, values).items():
                field = fields[name][layers]
                value = value.reshape(field.shape[0], len(todo), *value.shape[1:])
                field.index_copy_(1, on_device, value.to(field.dtype))
        computed[:, todo] = self.generation[todo]

    def read(self, flow, layer: int, block_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """`flow`'s fields of blocks `block_ids` at `layer` (float32) as last refreshed."""
        specs = flow.create_cache()
        if not specs:
            return {}
        fields = self.fields[self._stage(flow, specs)]
        return {name: fields[name][layer].index_select(0, block_ids).float() for name in specs}

    def layer_field(self, flow, layer: int, name: str) -> torch.Tensor:
        """Field `name` of every block of the pool at `layer` ([pool_blocks, kv_heads, *shape], in
        the cache's dtype), for a flow that reads it in place; current for the blocks refreshed."""
        return self.fields[self._stage(flow, flow.create_cache())][name][layer]

    def _stage(self, flow, specs: dict[str, tuple[int, ...]]) -> tuple:
        """The key of `flow`'s cache stage (what computes its fields, and their shapes), its
        tensors allocated on first use."""
        compute = type(flow).forward_cache
        stage = (compute.__module__, compute.__qualname__, tuple(sorted(specs.items())))
        if stage not in self.computed:
            layers, _, num_blocks, _, heads, dim = self.kv_cache.shape
            self.fields[stage] = {
                name: torch.zeros(layers, num_blocks, heads, *(dim if s == -1 else s for s in shape),
                                  dtype=self.kv_cache.dtype, device=self.kv_cache.device)  # half of float32
                for name, shape in specs.items()}
            self.computed[stage] = torch.full((layers, num_blocks), -1, dtype=torch.long)
        return stage
