"""CUDA graphs of the decode step: the model's forward for a batch of one token per sequence,
captured once per batch-size bucket (and with or without span rotation), then replayed with its
inputs refilled in place. A decode step of a small model is hundreds of kernel launches whose
Python and launch cost exceeds their work; a replay is one launch.

The graphs read static buffers: token ids, positions, cache slots, block tables, context lengths
and span rotation deltas. Padding rows of a bucket write their KV into a scratch block the
runner keeps outside the pool and attend only to it, so they never touch a sequence's cache.
"""

import torch

from spanserve.attention import AttentionMetadata
from spanserve.attention.triton_paged import KernelPlan, kernel_handles, num_splits

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_model_len: int, block_size: int, scratch_block: int):
        self.model, self.block_size, self.scratch_block = model, block_size, scratch_block
        self.sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        device = model.embed_tokens.weight.device
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=device)  # noqa: E731
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.block_tables = zeros(max_batch, -(-max_model_len // block_size))
        self.ctx_lens, self.rot_lens = zeros(max_batch), zeros(max_batch)
        self.rot_deltas = zeros(max_batch, max_model_len)
        self.max_model_len = max_model_len
        # (bucket, rotates?) -> (graph, its output, its metadata: the graph reads the plan's
        # tensors, so they must live as long as it does)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        self.pool = None

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode step the graphs can replay: one query per sequence, few enough sequences,
        and attention the kernel computes (the reference's fallback reads host-side lengths)."""
        return (meta.sparse is None and all(q == 1 for q in meta.query_lens) and len(meta.query_lens) <= self.sizes[-1]
                and kernel_handles(meta, self.model.cfg.head_dim))

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [B, hidden] of the step."""
        batch = len(meta.query_lens)
        size = next(s for s in self.sizes if s >= batch)
        rotate = meta.key_rotation is not None
        if (size, rotate) not in self.graphs:
            self._pad(0, size)
            self.graphs[size, rotate] = self._capture(size, rotate)
        self._fill(batch, size, input_ids, meta)
        graph, hidden, _ = self.graphs[size, rotate]
        graph.replay()
        return hidden[:batch]

    def _fill(self, batch: int, size: int, input_ids, meta: AttentionMetadata) -> None:
        self.input_ids[:batch] = input_ids
        self.positions[:batch] = meta.positions
        self.slots[:batch] = meta.slot_mapping
        self.block_tables[:batch, : meta.block_tables.shape[1]] = meta.block_tables
        self.ctx_lens[:batch] = meta.context_lens_tensor
        self.rot_lens[:batch] = 0
        for i, rotation in enumerate(meta.key_rotation or []):
            if rotation is not None:
                self.rot_lens[i] = len(rotation)
                self.rot_deltas[i, : len(rotation)] = rotation.deltas
        self._pad(batch, size)

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end become padding: token 0 at position 0 in the scratch block."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self.scratch_block * self.block_size
        self.block_tables[start:end, 0] = self.scratch_block
        self.ctx_lens[start:end] = 1
        self.rot_lens[start:end] = 0

    def _capture(self, size: int, rotate: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]:
        meta = self._static_meta(size, rotate)
        args = (self.input_ids[:size], self.positions[:size], meta)
        self.model(*args)  # compiles the kernels and sets up cuBLAS outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(*args)
        self.pool = graph.pool()
        return graph, hidden, meta

    def _static_meta(self, size: int, rotate: bool) -> AttentionMetadata:
        """Metadata over the static buffers, with the kernel plan built in (no per-step plan)."""
        cfg, device = self.model.cfg, self.input_ids.device
        group = cfg.num_heads // cfg.num_kv_heads
        rows = torch.arange(size, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], query_lens=[1] * size, context_lens=[1] * size,
            block_tables=self.block_tables[:size], context_lens_tensor=self.ctx_lens[:size],
            positions=self.positions[:size],
        )
        rope = self.model.rope
        meta.derived["kernel_plan"] = KernelPlan(
            tile_seq=rows, tile_row=torch.zeros_like(rows), q_starts=rows, q_lens=torch.ones_like(rows),
            ctx_lens=self.ctx_lens[:size], block_tables=self.block_tables[:size], positions=self.positions[:size],
            rot_lens=self.rot_lens[:size] if rotate else None, rot_deltas=self.rot_deltas[:size] if rotate else None,
            rope_tables=(rope.cos, rope.sin) if rotate else None, block_m=16 if group <= 16 else 64,
            num_splits=num_splits(size * cfg.num_kv_heads, self.max_model_len, device),
        )
        return meta
