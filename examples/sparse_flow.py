"""A user-written sparse decode flow: blocks whose keys point most along the query, by head.

Load it by dotted path and name it per request:
    llm = LLM(sparse_flows=["examples.sparse_flow.PeakHead"])
    llm.generate(prompt, SamplingParams(sparse="peak_head", sparse_budget=1024))
    spanserve serve --sparse-flow examples.sparse_flow.PeakHead
"""

import torch

from spanserve.sparse.flow import Flow, select


class PeakHead(Flow):
    name = "peak_head"
    recent_blocks = 2

    def create_cache(self):
        return {"direction": (-1,)}  # one vector per block and KV head

    def forward_cache(self, keys, values):
        mean = keys.float().mean(1)  # [blocks, heads, D]
        return {"direction": mean / mean.norm(dim=-1, keepdim=True).clamp_min(1e-6)}

    def forward_indexer(self, q, fields, state, ctx):
        scores = torch.einsum("hgd,bhd->bhg", q.float(), fields["direction"])
        return select(scores.amax((1, 2)), self, ctx)  # the block's best head decides
