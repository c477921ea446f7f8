"""ModelRunner: the only place that touches tensors. Turns a scheduled batch into a flat
token batch with its cache metadata, runs the model, and samples."""

from contextlib import contextmanager, nullcontext

import torch

from spanserve.attention import AttentionMetadata, KeyRotation
from spanserve.engine.sampler import Sample, sample
from spanserve.engine.scheduler import ScheduledRequest
from spanserve.heap import keep_freed_memory
from spanserve.models.llama import LlamaModel
from spanserve.threads import step_threads, use_pool_for_matmuls


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        cfg = model.cfg
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=dtype, device=device,
        )
        model.bind_kv_cache(self.kv_cache)
        self.encoder = None  # a CombPlugin attached to the model (spanserve/comb/), if any
        if device.type == "cpu":
            use_pool_for_matmuls(model)
            keep_freed_memory()

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> list[Sample]:
        """Run one step; returns one Sample per request in `batch` whose `samples` is True."""
        input_ids, positions, meta, logit_rows, encoder_rows = self._prepare(batch)
        with self._threads(len(input_ids)), self._encoding(encoder_rows):
            hidden = self.model(input_ids, positions, meta)
            if not logit_rows:
                return []
            logits = self.model.compute_logits(hidden[logit_rows]).cpu()
            return sample(logits, [item.request for item in batch if item.samples])

    @contextmanager
    def _encoding(self, rows: list[int]):
        """While the model runs, the encoder plug-in's deltas apply to `rows` (span tokens of
        requests with link policy comb); the other rows see the plain decoder."""
        if not rows:
            yield
            return
        self.encoder.rows = self._tensor(rows)
        try:
            yield
        finally:
            self.encoder.rows = None

    def _threads(self, num_tokens: int):
        return step_threads(num_tokens) if self.device.type == "cpu" else nullcontext()

    def _prepare(self, batch: list[ScheduledRequest]):
        input_ids, positions, slots, logit_rows = [], [], [], []
        query_lens, context_lens, contiguous_from, tables, rotations = [], [], [], [], []
        encoder_rows = []
        for item in batch:
            encodes = item.request.layout.link.name == "comb"
            for tokens, pos, table, ctx_len, layout, samples, in_span in _sequences(item):
                if encodes and in_span:
                    encoder_rows.extend(range(len(input_ids), len(input_ids) + len(tokens)))
                input_ids.extend(tokens)
                positions.extend(pos)
                slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in pos)
                tables.append(table)
                contiguous = table == list(range(table[0], table[0] + len(table)))
                contiguous_from.append(table[0] if contiguous else None)
                query_lens.append(len(pos))
                context_lens.append(ctx_len)
                rotations.append(self._rotation(layout, ctx_len))
                if samples:
                    logit_rows.append(len(input_ids) - 1)
        block_tables = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = torch.tensor(table)
        to = self._tensor
        meta = AttentionMetadata(
            slot_mapping=to(slots), query_lens=query_lens, context_lens=context_lens,
            block_tables=block_tables.to(self.device), context_lens_tensor=to(context_lens),
            positions=to(positions), contiguous_from=contiguous_from,
            key_rotation=rotations if any(r is not None for r in rotations) else None,
        )
        return to(input_ids), meta.positions, meta, logit_rows, encoder_rows

    def _rotation(self, layout, ctx_len: int) -> KeyRotation | None:
        """What moves each cached key of a sequence from where it was computed to where it is
        now; built once per layout (not per step) and reused while its deltas stay the same."""
        if layout is None or ctx_len <= layout.first_shifted_key():
            return None
        rotation = layout.derived.get("key_rotation")
        if rotation is None:
            rope, deltas = self.model.rope, layout.key_deltas().to(self.model.rope.cos.device)
            index, sign = deltas.abs(), deltas.sign().unsqueeze(-1).float()  # R(-a): cos a, -sin a
            rotation = KeyRotation.from_angles(rope.cos[index], sign * rope.sin[index], self.model.cfg.num_kv_heads)
            layout.derived["key_rotation"] = rotation
        return rotation

    @torch.inference_mode()
    def prefill_pinned(self, token_ids: list[int], block_ids: list[int]) -> None:
        """Compute the KV of a fixed token sequence from position 0 into blocks the engine keeps
        for good (the span anchor)."""
        bs, n = self.block_size, len(token_ids)
        positions = self._tensor(list(range(n)))
        meta = AttentionMetadata(
            slot_mapping=self._tensor([block_ids[p // bs] * bs + p % bs for p in range(n)]), query_lens=[n],
            context_lens=[n], block_tables=self._tensor(block_ids)[None], context_lens_tensor=self._tensor([n]),
            positions=positions,
        )
        self.model(self._tensor(token_ids), positions, meta)

    @torch.inference_mode()
    def blend_deviation(self, req) -> tuple[list[int], torch.Tensor]:
        """CacheBlend's signal for each independent span token of `req`: how far its second-
        layer K and V move when the first layer sees the whole context instead of its span.

        The first layer's keys need no recomputation (before any attention they are the same
        in a span or in context, up to the rotation we apply anyway), so one layer of attention
        over the cache, plus the second layer's projections, is the whole cost."""
        layout, bs = req.layout, self.block_size
        tokens = layout.independent.nonzero()[0].tolist()
        span_view = [(req.shadows.get(i) or b).block_id for i, b in enumerate(req.block_table)]
        own_view = [b.block_id for b in req.block_table]  # unused until relinked: a scratch pad
        to = self._tensor
        positions = to(tokens)
        ctx_len = tokens[-1] + 1
        meta = AttentionMetadata(
            slot_mapping=to([own_view[t // bs] * bs + t % bs for t in tokens]), query_lens=[len(tokens)],
            context_lens=[ctx_len], block_tables=to(span_view)[None], context_lens_tensor=to([ctx_len]),
            positions=positions, key_rotation=[self._rotation(layout, ctx_len)],
        )
        first, second = self.model.layers[0], self.model.layers[1]
        hidden = first(self.model.embed_tokens(to([req.token_ids[t] for t in tokens])), positions, meta)
        k, v = second.self_attn.key_values(second.input_layernorm(hidden), positions)
        slots = to([span_view[t // bs] * bs + t % bs for t in tokens])
        cache = self.kv_cache[1]
        cached_k = cache[0].flatten(0, 1)[slots]
        cached_v = cache[1].flatten(0, 1)[slots]
        rotation = meta.key_rotation[0]
        if rotation is not None:
            cached_k = KeyRotation(rotation.cos[positions], rotation.sin[positions]).apply(cached_k)
        return tokens, _relative_change(k, cached_k) + _relative_change(v, cached_v)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): src -> dst."""
        if pairs:
            src, dst = (self._tensor(list(ids)) for ids in zip(*pairs))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per token: squared distance between two [T, heads, D] tensors, over old's mean square."""
    new, old = new.float(), old.float()
    return (new - old).pow(2).sum((1, 2)) / old.pow(2).sum((1, 2)).mean().clamp_min(1e-12)


def _sequences(item: ScheduledRequest):
    """The attention sequences of one scheduled request: (tokens, positions, block ids, context
    length, layout whose span keys need rotating, samples?, in a span?). A span chunk is a sequence
    of its own whose positions count from the span's start; the in-context chunk sees everything."""
    req = item.request
    for chunk in item.span_chunks:
        span = req.layout.spans[chunk.span]
        shift = span.start - span.offset  # token t sits at t - shift in its own sub-sequence
        table = [b.block_id for b in req.span_table(chunk.span)]
        pos = range(chunk.start - shift, chunk.end - shift)
        yield req.token_ids[chunk.start:chunk.end], pos, table, chunk.end - shift, None, False, True
    start = req.num_computed_tokens
    if item.end > start:
        pos = req.layout.in_context(start, item.end)
        if pos:  # keys past the last query (a finished span's tail) are not needed yet
            tokens = [req.token_ids[i] for i in pos]
            yield tokens, pos, [b.block_id for b in req.block_table], pos[-1] + 1, req.layout, item.samples, False
