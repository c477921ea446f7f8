"""CUDA graphs of the decode step: the model's forward for a batch of the same few tokens per
sequence (one in plain decode; a speculative verify step's drafts and one more), captured once
per batch-size bucket, tokens per sequence and with or without span rotation, then replayed with
its inputs refilled in place. A decode step of a small model is hundreds of kernel launches whose
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
    def __init__(self, model, max_batch: int, max_model_len: int, block_size: int, scratch_block: int,
                 max_query: int = 1):
        """max_query: the most tokens of one sequence a replayed step holds (at most a block:
        a padding sequence's tokens all go to the scratch block)."""
        self.model, self.block_size, self.scratch_block = model, block_size, scratch_block
        self.sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_query = min(max_query, block_size)
        device = model.embed_tokens.weight.device
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=device)  # noqa: E731
        rows = max_batch * self.max_query
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.block_tables = zeros(max_batch, -(-max_model_len // block_size))
        self.ctx_lens, self.rot_lens = zeros(max_batch), zeros(max_batch)
        self.rot_deltas = zeros(max_batch, max_model_len)
        self.max_model_len = max_model_len
        # (bucket, tokens per sequence, rotates?) -> (graph, its output, its metadata: the graph
        # reads the plan's tensors, so they must live as long as it does)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        self.pool = None

    def fits(self, meta: AttentionMetadata) -> bool:
        """A step the graphs can replay: as many queries in every sequence (up to max_query),
        few enough sequences, and attention the kernel computes (the reference's fallback reads
        host-side lengths)."""
        q = meta.query_lens[0] if meta.query_lens else 0
        return (q > 0 and meta.sparse is None and q <= self.max_query and all(n == q for n in meta.query_lens)
                and len(meta.query_lens) <= self.sizes[-1] and kernel_handles(meta, self.model.cfg.head_dim))

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [B * tokens per sequence, hidden] of the step."""
        batch, q = len(meta.query_lens), meta.query_lens[0]
        size = next(s for s in self.sizes if s >= batch)
        key = (size, q, meta.key_rotation is not None)
        if key not in self.graphs:
            self._pad(0, size, q)
            self.graphs[key] = self._capture(*key)
        self._fill(batch, size, q, input_ids, meta)
        graph, hidden, _ = self.graphs[key]
        graph.replay()
        return hidden[: batch * q]

    def _fill(self, batch: int, size: int, q: int, input_ids, meta: AttentionMetadata) -> None:
        rows = batch * q
        self.input_ids[:rows] = input_ids
        self.positions[:rows] = meta.positions
        self.slots[:rows] = meta.slot_mapping
        self.block_tables[:batch, : meta.block_tables.shape[1]] = meta.block_tables
        self.ctx_lens[:batch] = meta.context_lens_tensor
        self.rot_lens[:batch] = 0
        for i, rotation in enumerate(meta.key_rotation or []):
            if rotation is not None:
                self.rot_lens[i] = len(rotation)
                self.rot_deltas[i, : len(rotation)] = rotation.deltas
        self._pad(batch, size, q)

    def _pad(self, start: int, end: int, q: int) -> None:
        """Sequences start..end become padding: tokens 0 at positions 0..q-1 of the scratch block."""
        if end <= start:
            return
        offsets = 0 if q == 1 else torch.arange(q, device=self.slots.device).repeat(end - start)
        self.input_ids[start * q:end * q] = 0
        self.positions[start * q:end * q] = offsets
        self.slots[start * q:end * q] = self.scratch_block * self.block_size + offsets
        self.block_tables[start:end, 0] = self.scratch_block
        self.ctx_lens[start:end] = q
        self.rot_lens[start:end] = 0

    def _capture(self, size: int, q: int, rotate: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]:
        meta = self._static_meta(size, q, rotate)
        args = (self.input_ids[: size * q], self.positions[: size * q], meta)
        self.model(*args)  # compiles the kernels and sets up cuBLAS outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(*args)
        self.pool = graph.pool()
        return graph, hidden, meta

    def _static_meta(self, size: int, q: int, rotate: bool) -> AttentionMetadata:
        """Metadata over the static buffers, with the kernel plan built in (no per-step plan):
        the tiles plan_step would lay out for q tokens in each of `size` sequences."""
        cfg, device = self.model.cfg, self.input_ids.device
        rows = q * (cfg.num_heads // cfg.num_kv_heads)
        block_m = 16 if rows <= 16 else 64
        per_seq = -(-rows // block_m)
        seqs = torch.arange(size, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=self.slots[: size * q], query_lens=[q] * size, context_lens=[q] * size,
            block_tables=self.block_tables[:size], context_lens_tensor=self.ctx_lens[:size],
            positions=self.positions[: size * q],
        )
        rope = self.model.rope
        meta.derived["kernel_plan"] = KernelPlan(
            tile_seq=seqs.repeat_interleave(per_seq),
            tile_row=torch.arange(per_seq, dtype=torch.int32, device=device).repeat(size) * block_m,
            q_starts=seqs * q, q_lens=torch.full_like(seqs, q),
            ctx_lens=self.ctx_lens[:size], block_tables=self.block_tables[:size], positions=self.positions[: size * q],
            rot_lens=self.rot_lens[:size] if rotate else None, rot_deltas=self.rot_deltas[:size] if rotate else None,
            rope_tables=(rope.cos, rope.sin) if rotate else None, block_m=block_m,
            num_splits=num_splits(size * per_seq * cfg.num_kv_heads, self.max_model_len, device),
        )
        return meta
