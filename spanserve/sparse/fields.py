"""FieldStore: the flows' per-block fields, in the paged pool beside K and V.

One tensor per (flow, field) of shape [layers, num_blocks, kv_heads, *shape], indexed by block id,
filled when a request's indexer first needs a full block's fields and kept while the block holds
the same keys: the pool counts each block's rewrites (BlockPool.generation: a new allocation, a
session moving its keys), and a field computed under an older count is computed again. A block
shared by the prefix cache is therefore summarized once for every request reading it.

Span blocks: their keys sit where the span was computed. A request decoding over moved span keys
does so over private copies rotated to its positions (engine span_key_copies), whose fields are
computed from the moved keys; a request still reading the shared blocks rotated at each step
decodes with full attention (sparse.py).
"""

import torch


class FieldStore:
    def __init__(self, kv_cache: torch.Tensor, generation: torch.Tensor):
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.generation = generation  # [num_blocks] the pool's per-block rewrite counts (CPU)
        self.fields: dict[tuple[str, str], torch.Tensor] = {}
        self.computed: dict[str, torch.Tensor] = {}  # flow -> [layers, num_blocks] generation, -1: none

    def get(self, flow, layer: int, block_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """`flow`'s fields of blocks `block_ids` at `layer` (float32), computing the missing or stale ones."""
        specs = flow.create_cache()
        if not specs:
            return {}
        self._allocate(flow, specs)
        ids = block_ids.cpu()
        current = self.generation[ids]
        stale = ids[self.computed[flow.name][layer, ids] != current]
        if len(stale):
            on_device = stale.to(block_ids.device)
            keys, values = self.kv_cache[layer, 0, on_device], self.kv_cache[layer, 1, on_device]
            for name, value in flow.forward_cache(keys, values).items():
                self.fields[flow.name, name][layer, on_device] = value.to(self.fields[flow.name, name].dtype)
            self.computed[flow.name][layer, stale] = self.generation[stale]
        return {name: self.fields[flow.name, name][layer, block_ids].float() for name in specs}

    def _allocate(self, flow, specs: dict[str, tuple[int, ...]]) -> None:
        if flow.name in self.computed:
            return
        layers, _, num_blocks, _, heads, dim = self.kv_cache.shape
        for name, shape in specs.items():
            shape = tuple(dim if s == -1 else s for s in shape)
            self.fields[flow.name, name] = torch.zeros(layers, num_blocks, heads, *shape, dtype=self.kv_cache.dtype,
                                                       device=self.kv_cache.device)  # half of float32
        self.computed[flow.name] = torch.full((layers, num_blocks), -1, dtype=torch.long)
