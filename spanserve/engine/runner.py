"""ModelRunner: the only place that touches tensors. Turns a scheduled batch into a flat
token batch with its cache metadata, runs the model, and samples."""

from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from spanserve.attention import AttentionMetadata, KeyRotation, SpanShare
from spanserve.attention.torch_ref import fold_query_heads, step_rotations, store_kv
from spanserve.attention.triton_paged import TritonAttention
from spanserve.engine.cuda_graphs import DecodeGraphs
from spanserve.engine.sampler import Sample, sample, verify
from spanserve.engine.scheduler import ScheduledRequest
from spanserve.engine.step_times import ModelClock
from spanserve.heap import keep_freed_memory
from spanserve.kernels import calibration, cpu_kernel
from spanserve.kernels.threads import step_threads, use_pool_for_matmuls
from spanserve.models.llama import ForwardStopped, LlamaModel
from spanserve.pic.focus import focus_blocks, span_blocks
from spanserve.pic.voters import ProbeVoters
from spanserve.sparse.decode import SparseStep
from spanserve.sparse.fields import FieldStore

FOCUS_ROWS = 8  # focus_select: the question's last tokens whose attention scores the spans


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device, graph_batch: int = 0, max_model_len: int = 0,
                 block_generation: torch.Tensor | None = None, graph_query: int = 1,
                 model_clock: ModelClock | None = None):
        """kv_dtype: the cache's (the model's, or bf16 under a float32 model). graph_batch > 0:
        replay decode steps of up to that many sequences as CUDA graphs (Triton backend only), for
        contexts up to max_model_len, and steps of up to graph_query tokens per sequence (a
        speculative verify step's drafts and one more). block_generation: the pool's per-block
        rewrite counts, which keep sparse flows' fields fresh. model_clock: where the forward passes'
        time is summed (engine/step_times.py)."""
        cfg = model.cfg
        self.model, self.block_size, self.device = model, block_size, device
        self.model_dtype = model.embed_tokens.weight.dtype
        graphs = graph_batch > 0 and isinstance(model.layers[0].self_attn.backend, TritonAttention)
        self.kv_cache = torch.zeros(  # with graphs, one more block: the padding rows' scratch
            cfg.num_layers, 2, num_blocks + graphs, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=kv_dtype, device=device,
        )
        model.bind_kv_cache(self.kv_cache)
        generation = block_generation if block_generation is not None else torch.zeros(num_blocks + 1, dtype=torch.long)
        self.fields = FieldStore(self.kv_cache, generation)
        self.graphs = (DecodeGraphs(model, graph_batch, max_model_len, block_size, num_blocks, graph_query)
                       if graphs else None)
        self.encoder = None  # the span encoder plug-in (spanserve/comb/), see use_encoder
        self.encoder_reads = False  # whether it has reader deltas
        self.voters = ProbeVoters.default(cfg.num_layers, cfg.num_heads)  # of the focus probe (pic/voters.py)
        self.encoder_voters = self.voters  # the plug-in's own, for requests it encodes
        # On CPU a speculative verify step attends row by row through the decode kernel, so each row
        # is computed as its own decode step would be: the same greedy tokens in bf16 and under
        # quantization too, where the prefill kernel's other rounding flipped near-ties (SmolLM2 bf16,
        # Qwen 1.5B w8a8). It costs nothing measurable (`spanserve bench speculative`); on a GPU the
        # step stays one sequence, for its CUDA graphs.
        self.verify_by_row = device.type == "cpu"
        self.model_clock = model_clock or ModelClock()
        # bf16 decode and prefill attention's measured paths on CPU (kernels/calibration.py)
        self.decode_bf16_dot = self.prefill_bf16_dot = None
        if device.type == "cpu":
            use_pool_for_matmuls(model)
            keep_freed_memory()
            cpu_kernel.load()  # built now (seconds, once per machine) rather than in the first request
            if self.model_dtype == kv_dtype == torch.bfloat16:
                shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
                self.decode_bf16_dot = calibration.use_decode_bf16_dot(*shape)
                self.prefill_bf16_dot = calibration.use_prefill_bf16_dot(*shape)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest],
                stop: Callable[[], bool] | None = None) -> list[list[Sample]] | None:
        """Run one step; returns the tokens of each request in `batch` whose `samples` is True: one,
        or for a request with a draft, the drafts the target accepts and one more. With
        `stop`, the step may end early, between two layers, once stop() is True: then None (its
        tokens are computed again in a later step). A CUDA graph replay never stops."""
        input_ids, positions, meta, logit_rows, plugin_rows = self._prepare(batch)
        with self._threads(len(input_ids)), self._encoding(*plugin_rows):
            with self.model_clock:  # the forward pass and the LM head, not the host work around them
                if self.graphs is not None and not any(plugin_rows) and self.graphs.fits(meta):
                    hidden = self.graphs.run(input_ids, meta)[logit_rows]
                else:
                    # the last layer computes the sampled rows alone; a plug-in's deltas index every row
                    keep = None if any(plugin_rows) else self._tensor(logit_rows)
                    try:
                        hidden = self.model(input_ids, positions, meta, stop, keep)
                    except ForwardStopped:
                        return None
                    hidden = hidden if keep is not None else hidden[logit_rows]
                if not logit_rows:
                    return []
                logits = self.model.compute_logits(hidden).cpu()
            return _samples(logits, [item for item in batch if item.samples])

    def use_encoder(self, plugin) -> None:
        """Attach a CombPlugin: its deltas then apply to the rows of requests whose link policy
        encodes spans (encoder deltas to span tokens, reader deltas to the tokens after them)."""
        plugin.attach(self.model)
        self.encoder = plugin
        self.encoder_reads = plugin.has_reader  # read once: a serving plug-in never changes
        self.encoder_voters = plugin.voters(self.model) or self.voters

    @contextmanager
    def _encoding(self, rows: list[int], reader_rows: list[int]):
        """While the model runs, the plug-in's deltas apply to those rows; the other rows see
        the plain decoder."""
        if not rows and not reader_rows:
            yield
            return
        with self.encoder.active(self._tensor(rows) if rows else None,
                                 self._tensor(reader_rows) if reader_rows else None):
            yield

    def _threads(self, num_tokens: int):
        return step_threads(num_tokens) if self.device.type == "cpu" else nullcontext()

    def _prepare(self, batch: list[ScheduledRequest]):
        input_ids, positions, slots, logit_rows = [], [], [], []
        query_lens, context_lens, contiguous_from, tables, rotations = [], [], [], [], []
        encoder_rows, reader_rows, shares, sparse = [], [], [], {}
        for item in batch:
            for tokens, pos, table, ctx_len, layout, samples, in_span in _sequences(item, self.verify_by_row):
                if item.request.sparse is not None and not in_span and item.request.sparse.covers(len(pos), samples):
                    sparse[len(tables)] = item.request.sparse
                encoder, reader = self._plugin_rows(item.request.layout, pos, in_span)
                encoder_rows.extend(len(input_ids) + i for i in encoder)
                reader_rows.extend(len(input_ids) + i for i in reader)
                input_ids.extend(tokens)
                positions.extend(pos)
                slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in pos)
                tables.append(table)
                contiguous = table == list(range(table[0], table[0] + len(table)))
                contiguous_from.append(table[0] if contiguous else None)
                query_lens.append(len(pos))
                context_lens.append(ctx_len)
                rotations.append(None if self._settled(layout, table) else self._rotation(layout, ctx_len))
                shares.append(self._span_share(layout, ctx_len))
                if samples:  # the last token's row, and a draft's each (a sparse verify row is a sequence)
                    logit_rows.extend(range(len(input_ids) - min(len(pos), 1 + item.drafts), len(input_ids)))
        block_tables = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = torch.tensor(table)
        to = self._tensor
        meta = AttentionMetadata(
            slot_mapping=to(slots), query_lens=query_lens, context_lens=context_lens,
            block_tables=block_tables.to(self.device), context_lens_tensor=to(context_lens),
            positions=to(positions), contiguous_from=contiguous_from,
            key_rotation=rotations if any(r is not None for r in rotations) else None,
            span_share=shares if any(s is not None for s in shares) else None,
            sparse=SparseStep(self.fields, sparse, self.block_size) if sparse else None,
        )
        return to(input_ids), meta.positions, meta, logit_rows, (encoder_rows, reader_rows)

    def _plugin_rows(self, layout, pos, in_span: bool) -> tuple:
        """Which rows of one sequence the COMB plug-in's (encoder, reader) deltas apply to: a
        span's tokens, or the context tokens from the request's first span on."""
        if self.encoder is None or not layout.link.encodes_spans or not layout.spans:
            return (), ()
        if in_span:
            return range(len(pos)), ()
        if not self.encoder_reads:
            return (), ()
        first = layout.spans[0].start
        return (), [i for i, p in enumerate(pos) if p >= first]

    def _rotation(self, layout, ctx_len: int) -> KeyRotation | None:
        """What moves each cached key of a sequence from where it was computed to where it is
        now (and, under APE, divides span keys by the attention temperature: a factor on a key
        is one on its scores); built once per layout (not per step) and reused while its deltas
        stay the same."""
        if layout is None or ctx_len <= layout.first_shifted_key():
            return None
        rotation = layout.derived.get("key_rotation")
        if rotation is None:
            factors, weighting = None, layout.link.span_weighting
            if weighting is not None:
                factors = torch.ones(len(layout.key_deltas()))
                factors[torch.from_numpy(layout.independent[:len(factors)])] = weighting[0]
            rotation = layout.derived["key_rotation"] = self._key_rotation(layout.key_deltas(), factors)
        return rotation

    @torch.inference_mode()
    def settle_keys(self, layout, table: list[int], copies: list[tuple[int, int]]) -> None:
        """Decode reads a request's moved span keys at every step: rotate them once instead, in the
        private copies the KV manager just made of their blocks (`copies`, source -> copy), every
        layer. `table` is the request's context view afterwards; while it starts with the same
        blocks, its keys need no rotation (a preempted request gets shared blocks back, and rotates
        again)."""
        self.copy_blocks(copies)
        rotation = self._rotation(layout, 1 << 62)
        num_blocks = -(-len(rotation) // self.block_size)
        blocks = self._tensor(table[:num_blocks])  # rotated from key 0, as the rotation counts keys
        first = num_blocks - len(copies)  # the copies are the last blocks holding moved keys
        for layer in self.kv_cache:  # [2, num_blocks, block_size, kv_heads, head_dim]
            # rotated in float32 and rounded once where the cache is narrower than the model
            keys = layer[0, blocks].flatten(0, 1).to(self.model_dtype)
            keys = rotation.rotate_(keys).view(num_blocks, self.block_size, -1, layer.shape[-1])
            layer[0, blocks[first:]] = keys[first:].to(layer.dtype)  # blocks before the first moved key stay untouched
        layout.derived["settled_blocks"] = tuple(table[:num_blocks])

    @torch.inference_mode()
    def move_blocks(self, pairs: list[tuple[int, int]], delta: int, chunk: int = 256) -> None:
        """Move whole blocks of cached tokens `delta` positions (a session dropping its oldest data
        moves the rest back): block src's values and its keys, rotated by RoPE, go to dst (src
        itself when nobody else reads it). Rotated in float32 and rounded once; values do not
        depend on position."""
        rotation = self._key_rotation(torch.full((chunk * self.block_size,), delta))
        for i in range(0, len(pairs), chunk):
            src, dst = (self._tensor(list(ids)) for ids in zip(*pairs[i:i + chunk]))
            for layer in self.kv_cache:  # [2, num_blocks, block_size, kv_heads, head_dim]
                keys = layer[0, src].float()
                rotated = rotation.rotate_(keys.flatten(0, 1)).view_as(keys)
                layer[0, dst] = rotated.to(layer.dtype)
                layer[1, dst] = layer[1, src]

    def _settled(self, layout, table: list[int]) -> bool:
        settled = layout.derived.get("settled_blocks") if layout is not None else None
        return settled is not None and tuple(table[: len(settled)]) == settled

    def _key_rotation(self, deltas: torch.Tensor, factors: torch.Tensor | None = None) -> KeyRotation:
        """Rotate key j back by deltas[j] positions (and multiply it by factors[j])."""
        rope = self.model.rope
        deltas = deltas.to(rope.cos.device)
        index, sign = deltas.abs(), deltas.sign().unsqueeze(-1).float()  # R(-a): cos a, -sin a
        cos, sin = rope.cos[index], sign * rope.sin[index]
        if factors is not None:
            factors = factors.to(cos.device, cos.dtype).unsqueeze(-1)
            return KeyRotation.from_angles(cos * factors, sin * factors, self.model.cfg.num_kv_heads)
        return KeyRotation(cos, sin, self.model.cfg.num_kv_heads, deltas.to(torch.int32), (rope.cos, rope.sin))

    def _span_share(self, layout, ctx_len: int) -> SpanShare | None:
        """APE: which keys of a sequence are span keys and the power of their summed weight."""
        weighting = None if layout is None else layout.link.span_weighting
        if weighting is None or ctx_len <= layout.first_shifted_key():
            return None
        share = layout.derived.get("span_share")
        if share is None:
            keys = torch.from_numpy(layout.independent[:len(layout.key_deltas())]).to(self.device)
            share = layout.derived["span_share"] = SpanShare(keys, weighting[1])
        return share

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

    @property
    def max_blend_checks(self) -> int:
        """Check layers a CacheBlend probe can have: the second layer to the last."""
        return len(self.model.layers) - 1

    @torch.inference_mode()
    def blend_select(self, req, counts: list[int]) -> list[int]:
        """CacheBlend's probe of `req` (its spans and the text before them computed, its span
        blocks all shadowed): the span tokens to recompute in context, by gradual filtering.

        Every span token is a candidate at the first check: all of them run the first layer
        in context, and the check keeps the counts[0] whose second-layer K and V deviate most
        from their cached span KV. Each later check runs only the previous one's picks through
        one more layer, attending to the whole context (their own fresh KV, the cached span KV
        of the other span tokens), and keeps counts[l] of them; the last check's picks are the
        answer. Text between spans (in context, not computed yet) runs with the picks at every
        layer, so they read it as it will be rather than whatever its blocks hold.

        CacheBlend also keeps a dropped token's KV from the layers where it was still picked;
        we keep none of the probe's KV: the picks are recomputed at every layer afterwards and
        the others keep their cached span KV."""
        layout = req.layout
        picks = np.flatnonzero(layout.independent)
        ctx_len = int(picks[-1]) + 1  # no probe query reads further
        between = np.asarray(layout.in_context(layout.spans[0].start, ctx_len), dtype=np.int64)
        rows = np.union1d(picks, between)
        hidden = self.model.embed_tokens(self._tensor([req.token_ids[t] for t in rows]))
        for layer, keep in enumerate(counts):
            hidden = self._probe_layer(req, layer, rows, picks, hidden, ctx_len)
            deviation = self._deviation(req, layer + 1, picks, hidden[self._rows(np.isin(rows, picks))])
            picks = np.sort(picks[deviation.topk(keep).indices.cpu().numpy()])
            kept = np.isin(rows, picks) | np.isin(rows, between)
            rows, hidden = rows[kept], hidden[self._rows(kept)]
        return picks.tolist()

    @torch.inference_mode()
    def focus_select(self, req, link) -> list[int]:
        """Query-aware relinking (link policies none and comb with focus_spans or focus_tokens,
        pic/link.py): the span tokens the request's question reads most (the focus probe's
        weights summed over voting heads and watched rows), to recompute in context: whole
        spans (focus_spans) or the blocks around the highest-scoring ones (focus_tokens, a
        budget; pic/focus.py). Which heads vote: pic/voters.py."""
        layout = req.layout
        span_keys = torch.from_numpy(layout.independent[:req.num_prompt_tokens])
        per_key = torch.where(span_keys, self.focus_weights(req).sum((0, 1)).cpu(), 0)
        picked = np.zeros_like(layout.independent)
        if link.focus_spans:
            score = torch.stack([per_key[s.start:s.end].sum() for s in layout.spans])
            for s in score.topk(min(link.focus_spans, len(layout.spans))).indices.tolist():
                picked[layout.spans[s].start:layout.spans[s].end] = True
        else:
            bs = self.block_size
            scores, span_of_block = span_blocks(per_key.numpy(), layout.spans, bs)
            for b in focus_blocks(scores, span_of_block, -(-link.focus_tokens // bs)):
                picked[b * bs:(b + 1) * bs] = True
        return np.flatnonzero(picked & layout.independent).tolist()

    def probe_voters(self, req) -> ProbeVoters:
        """The heads whose attention a request's focus probe sums: the plug-in's for a request it
        encodes (its attention reads the plug-in's KV), else the default."""
        return self.encoder_voters if req.layout.link.encodes_spans else self.voters

    @torch.inference_mode()
    def focus_weights(self, req, voters: ProbeVoters | None = None) -> torch.Tensor:
        """The focus probe: [voting (layer, head) pairs, watched rows, keys], the attention weight
        each key of the prompt gets from each voter (`voters`, default probe_voters(req)).

        Once its spans and the text before them are computed, the request's in-context tokens
        after its first span (text between spans, the question) run through the layers as a
        probe over the cached span KV (their own KV is scratch, recomputed after the relink). At
        each layer the last FOCUS_ROWS of them weigh every key."""
        layout = req.layout
        n = req.num_prompt_tokens
        voters = voters or self.probe_voters(req)
        rows = np.asarray(layout.in_context(layout.spans[0].start, n), dtype=np.int64)
        watched = self._tensor(rows[-FOCUS_ROWS:].tolist())
        weights = []
        hidden = self.model.embed_tokens(self._tensor([req.token_ids[t] for t in rows]))
        meta = self._probe_meta(req, rows, rows[:0], n)  # the same in every layer
        # Entered once around the layers, the plug-in's hooks go on once (120 projections: 0.28 ms
        # each time); the voters' context inside only names its rows.
        with self._reading(req, len(rows)):
            queries, done = {}, 0
            for layer in sorted(voters.by_layer):  # (the layers' keys land in the request's blocks)
                hidden = self._probe_layers(range(done, layer), hidden, meta)
                queries[layer], done = hidden[-len(watched):], layer
            self._store_keys(done, hidden, meta)  # the last voting layer's output is never read: only its keys
            for layer, layer_queries in queries.items():  # each layer's keys are stored now
                with self._reading(req, len(watched)):
                    heads = self._attention_weights(layer, layer_queries, watched, meta)
                weights.append(heads[voters.by_layer[layer]])
        return torch.cat(weights)

    def _probe_layers(self, layers: range, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Model layers `layers` over a focus probe's rows (hidden states `hidden`, `meta` its
        _probe_meta): in one C call where the model's fused layers take them."""
        fused = self.model.fused_layers
        out = fused(hidden, meta.positions, meta, layers) if fused is not None and len(layers) else None
        if out is not None:
            return out
        for layer in layers:
            hidden = self.model.layers[layer](hidden, meta.positions, meta)
        return hidden

    def _store_keys(self, layer: int, hidden: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write layer `layer`'s K and V of a probe's rows (hidden states `hidden`) where its
        attention would (meta.slot_mapping), without attending."""
        block = self.model.layers[layer]
        keys, values = block.self_attn.key_values(block.input_layernorm(hidden), meta.positions)
        store_kv(self.kv_cache[layer, 0], self.kv_cache[layer, 1], keys, values, meta.slot_mapping)

    def _reading(self, req, num_rows: int):
        """The COMB plug-in's reader deltas on every row of a probe call (its rows all follow the
        request's first span), where the request's policy has them."""
        if self.encoder_reads and req.layout.link.encodes_spans:
            return self._encoding([], list(range(num_rows)))
        return nullcontext()

    def _attention_weights(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                           meta: AttentionMetadata) -> torch.Tensor:
        """[heads, queries, keys]: the attention weight that layer `layer`'s queries from
        hidden states x (at `positions`) give the keys of a probe's one sequence (`meta`, its
        _probe_meta: its blocks, context length and rotation), as the layer's attention computes
        it (span keys moved to their real positions, causal). The scores come from the C kernel
        where it runs: a warm RAG prompt's three voting layers over 4k keys took 7.8 ms against
        the torch path's 13.2 (its gather of the keys, their rotation and a matmul; SmolLM2, AMD
        EPYC Zen 3)."""
        block = self.model.layers[layer]
        attn = block.self_attn
        q = attn.queries(block.input_layernorm(x), positions)
        k_cache, blocks, ctx_len = self.kv_cache[layer, 0], meta.block_tables[0], meta.context_lens[0]
        scores = cpu_kernel.paged_scores(q, k_cache, blocks, positions, ctx_len, attn.scale, step_rotations(meta, [0]))
        if scores is None:
            tokens = torch.arange(ctx_len, device=blocks.device)
            keys = k_cache.flatten(0, 1)[blocks[tokens // self.block_size] * self.block_size
                                         + tokens % self.block_size]  # a gathered copy: rotated in place
            if meta.key_rotation[0] is not None:
                meta.key_rotation[0].rotate_(keys)
            # each KV head's query heads in one matmul: [kv_heads, groups * queries, keys]
            folded = fold_query_heads(q.float(), attn.num_kv_heads)
            scores = torch.matmul(folded, keys.float().permute(1, 2, 0)) * attn.scale
            causal = tokens[None, :] <= positions[:, None]
            scores = scores.view(attn.num_heads, len(q), -1).masked_fill_(~causal, float("-inf"))
        return scores.softmax(-1)

    def _probe_layer(self, req, layer: int, rows: np.ndarray, fresh: np.ndarray, hidden: torch.Tensor,
                     ctx_len: int, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Run model layer `layer` for the probe's `rows`. Under CacheBlend the request's own
        span blocks are its scratch pad until relinked: they get this layer's cached span KV, then
        the rows' fresh KV over it (a focus probe's rows are all in context: it reads the shared
        span blocks and has no shadows). `meta`: _probe_meta's, when the rows stay the same."""
        pairs = [(shadow.block_id, req.block_table[i].block_id) for i, shadow in req.shadows.items()]
        if pairs:
            src, dst = (self._tensor(list(ids)) for ids in zip(*pairs))
            self.kv_cache[layer, :, dst] = self.kv_cache[layer, :, src]
        meta = meta or self._probe_meta(req, rows, fresh, ctx_len)
        return self.model.layers[layer](hidden, meta.positions, meta)

    def _probe_meta(self, req, rows: np.ndarray, fresh: np.ndarray, ctx_len: int) -> AttentionMetadata:
        """Where a probe's `rows` go in the request's blocks, attending to its first ctx_len keys;
        only the `fresh` span keys are not rotated (computed where they are)."""
        if len(fresh):
            deltas = req.layout.key_deltas().clone()
            deltas[torch.from_numpy(fresh)] = 0
            rotation = self._key_rotation(deltas) if deltas.any() else None
        else:  # a focus probe: the request's own rotation, built once (its tables too)
            rotation = self._rotation(req.layout, ctx_len)
        bs, to = self.block_size, self._tensor
        own = [b.block_id for b in req.block_table]
        return AttentionMetadata(
            slot_mapping=to([own[t // bs] * bs + t % bs for t in rows]), query_lens=[len(rows)],
            context_lens=[ctx_len], block_tables=to(own)[None], context_lens_tensor=to([ctx_len]),
            positions=to(rows.tolist()), key_rotation=[rotation],
        )

    def _deviation(self, req, layer: int, tokens: np.ndarray, hidden: torch.Tensor) -> torch.Tensor:
        """How far the K and V of span `tokens` at `layer`, from their fresh input `hidden`, are
        from their cached span KV (moved to their real positions): per token, the squared
        distance over the tokens' mean square, for K plus for V."""
        bs, attn = self.block_size, self.model.layers[layer]
        positions = self._tensor(tokens.tolist())
        k, v = attn.self_attn.key_values(attn.input_layernorm(hidden), positions)
        span_view = [(req.shadows.get(i) or b).block_id for i, b in enumerate(req.block_table)]
        slots = self._tensor([span_view[t // bs] * bs + t % bs for t in tokens])
        cached_k, cached_v = (part.flatten(0, 1)[slots] for part in self.kv_cache[layer])
        cached_k = self._key_rotation(req.layout.key_deltas()[torch.from_numpy(tokens)]).apply(cached_k)
        return _relative_change(k, cached_k) + _relative_change(v, cached_v)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): src -> dst, each dst a private block no pair
        reads. One strided copy per block: an index-tensor assignment over the pool's third
        dimension was 3-6x slower (1 to 50 blocks)."""
        for src, dst in pairs:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _rows(self, mask: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(mask).to(self.device)


def _relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per token: squared distance between two [T, heads, D] tensors, over old's mean square."""
    new, old = new.float(), old.float()
    return (new - old).pow(2).sum((1, 2)) / old.pow(2).sum((1, 2)).mean().clamp_min(1e-12)


def _samples(logits: torch.Tensor, items: list[ScheduledRequest]) -> list[list[Sample]]:
    """Each sampling item's tokens from its logit rows (one row, or one per draft token and one)."""
    if not any(item.drafts for item in items):
        return [[s] for s in sample(logits, [item.request for item in items])]
    out, row = [], 0
    for item in items:
        rows = logits[row:row + item.drafts + 1]
        drafts = item.request.token_ids[-item.drafts:] if item.drafts else []
        out.append(verify(rows, item.request, drafts) if item.drafts else sample(rows, [item.request]))
        row += item.drafts + 1
    return out


def _sequences(item: ScheduledRequest, verify_by_row: bool = False):
    """The attention sequences of one scheduled request: (tokens, positions, block ids, context
    length, layout whose span keys need rotating, samples?, in a span?). A span chunk is a sequence
    of its own whose positions count from the span's start; the in-context chunk sees everything
    (a verify step's rows, with `verify_by_row` or a sparse flow: a sequence each, as their decode
    steps would be; sparse/decode.py)."""
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
        if not pos:  # keys past the last query (a finished span's tail) are not needed yet
            return
        table = [b.block_id for b in req.block_table]
        if item.drafts and (verify_by_row or req.sparse is not None):
            for p in pos:
                yield [req.token_ids[p]], range(p, p + 1), table, p + 1, req.layout, item.samples, False
            return
        yield [req.token_ids[i] for i in pos], pos, table, pos[-1] + 1, req.layout, item.samples, False
