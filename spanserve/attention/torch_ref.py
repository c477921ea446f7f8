"""Reference attention in plain PyTorch: matmuls for prefill and SDPA for decode on CPU; SDPA on other devices.
On CPU, the C kernels (cpu_kernel.py) take decode tokens over keys read as cached and prefill
chunks (span keys rotated as they are read); the torch paths stay as their reference and fallback.
Sequences whose queries reweight span keys (APE's SpanShare) take the matmul paths everywhere:
the reweighting needs each query's scores before its softmax."""

from itertools import accumulate

import torch
import torch.nn.functional as F

from spanserve.attention.backend import AttentionBackend, AttentionMetadata, KeyRotation, decode_tables, plain_decode
from spanserve.kernels.cpu_kernel import paged_decode, paged_prefill
from spanserve.kernels.threads import attention_threads

# Sequences computing at most this many queries in a step (decode tokens, short prefill chunks
# over at most BATCH_MAX_CONTEXT keys) share one padded, masked call when there are two or more:
# a longer context would pad the others' keys to its length.
BATCH_MAX_QUERIES = 32
BATCH_MAX_CONTEXT = 1024
# On CPU a prefill chunk's attention is two matmuls and a masked softmax: 2x faster there than
# the flash kernel, which computes in float32 even for bf16. Its queries go in slices of at most
# this many scores (queries x heads x keys: 8 MB in bf16), each over the keys up to its last query.
MATMUL_SLICE_SCORES = 2**22


class TorchAttention(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, stored: bool = False):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if not stored:
            store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        plain = plain_decode(meta, q.device)
        if plain is not None:  # the common decode step, straight to the C kernel in every layer
            tables, lens, work = plain
            with attention_threads(q.shape[1] * work):
                out = paged_decode(q, k_cache, v_cache, tables, lens, scale)
            if out is not None:
                return out
        starts = [0]
        for q_len in meta.query_lens:
            starts.append(starts[-1] + q_len)
        out = torch.empty_like(q)
        rest = self._prefill_kernel(q, k_cache, v_cache, meta, scale, out)
        if not rest:
            return out
        # Decode tokens and short prefill chunks go through one padded, masked call, even
        # beside long prefills: per-sequence calls would cost more than their work.
        short = [i for i in rest if meta.query_lens[i] == 1 or
                 (meta.query_lens[i] <= BATCH_MAX_QUERIES and meta.context_lens[i] <= BATCH_MAX_CONTEXT)]
        if len(short) < 2:
            short = []
        if len(short) == len(meta.query_lens):
            with attention_threads(q.shape[1] * sum(meta.context_lens)):
                return self._batched(q, meta.positions, k_cache, v_cache, meta, scale, short)
        if short:
            rows = _rows_of(short, starts, q.device)
            with attention_threads(q.shape[1] * sum(meta.context_lens[i] for i in short)):
                out[rows] = self._batched(q[rows], meta.positions[rows], k_cache, v_cache, meta, scale, short)
        skip = set(short)
        for i in rest:
            if i not in skip:
                rows = slice(starts[i], starts[i + 1])
                with attention_threads(meta.query_lens[i] * q.shape[1] * meta.context_lens[i]):
                    out[rows] = self._one_sequence(i, q[rows], k[rows], v[rows], meta.positions[rows],
                                                   k_cache, v_cache, meta, scale)
        return out

    def _prefill_kernel(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                        out: torch.Tensor) -> list[int]:
        """The step's prefill chunks (their span keys rotated as they are read; not APE's span
        share), in one call of the C kernel on CPU (cpu_kernel.paged_prefill), written into `out`.
        Returns the sequences left to the other paths: all of them where the kernel cannot run."""
        everyone = list(range(len(meta.query_lens)))
        if q.device.type != "cpu":
            return everyone
        plan = prefill_plan(meta, q.device)
        if plan is None:
            return everyone
        chunks, rows, tables, query_starts, positions, lens, work = plan
        whole = rows is None
        with attention_threads(q.shape[1] * work):
            result = paged_prefill(q if whole else q[rows], k_cache, v_cache, tables, query_starts, positions, lens,
                                   scale, out if whole else None, step_rotations(meta, chunks))
        if result is None:
            return everyone
        if result is not out:  # a part of the step, or an `out` the kernel could not write in place
            out[slice(None) if whole else rows] = result
        taken = set(chunks)
        return [i for i in everyone if i not in taken]

    def _one_sequence(self, i, q, k, v, positions, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        q_len, ctx_len = len(q), meta.context_lens[i]
        rotation = meta.key_rotation[i] if meta.key_rotation else None
        share = meta.span_share[i] if meta.span_share else None
        on_cpu = q.device.type == "cpu"
        if q_len == ctx_len and rotation is None and share is None:
            # Whole context is in this batch: plain causal attention, no cache gather.
            if on_cpu:
                return _matmul_attention(q, _head_major(k), _head_major(v), positions, scale)
            return _sdpa(q, k, v, None, scale, causal=True)
        first = meta.contiguous_from[i] if meta.contiguous_from else None
        if (on_cpu and (q_len > 1 or rotation is not None)) or share is not None:  # moved span keys too
            rows = None if first is not None else _step_rows(meta, i, k_cache)
            gathered = gather_head_major(k_cache, v_cache, meta.block_tables[i], ctx_len, first, rows)
            keys, values = _as_queries(q, *gathered)
            if rotation is not None:
                # Elementwise and memory-bound: a second thread's wake-up cost more than it saved.
                with attention_threads(0):
                    rotation.rotate_(keys, head_major=True)
            return _matmul_attention(q, keys, values, positions, scale, share)
        if q_len == 1 and rotation is None:  # the newest token: it sees the whole context
            one = slice(i, i + 1)
            out = paged_decode(q, k_cache, v_cache, meta.block_tables[one], meta.context_lens_tensor[one], scale)
            if out is not None:
                return out
        keys, values = _as_queries(q, *gather_context(k_cache, v_cache, meta.block_tables[i], ctx_len, first))
        if q_len == 1:
            return _single_query(q, keys, values, scale, rotation)
        if rotation is not None:
            keys = rotation.apply(keys)
        return _sdpa(q, keys, values, causal_mask(positions, ctx_len), scale)

    def _batched(self, q, positions, k_cache, v_cache, meta: AttentionMetadata, scale: float, seqs: list[int]):
        """The queries of sequences `seqs` in one call (q and positions hold their rows in order):
        each sequence's queries padded to the most any has, its blocks gathered and padded to the
        longest context, and a mask for both."""
        rotations = [meta.key_rotation[i] for i in seqs] if meta.key_rotation else None
        q_lens = [meta.query_lens[i] for i in seqs]
        if max(q_lens) == 1:
            return _decode(q, k_cache, v_cache, meta, seqs, scale, rotations)
        block_size = k_cache.shape[1]
        index = torch.tensor(seqs, device=meta.block_tables.device)
        tables, lens = meta.block_tables[index], meta.context_lens_tensor[index]
        max_len = int(lens.max())
        tables = tables[:, : -(-max_len // block_size)]
        keys, values = _as_queries(q, *(gather_blocks(cache, tables).flatten(1, 2)[:, :max_len]  # [B, L, kv_heads, D]
                                        for cache in (k_cache, v_cache)))
        if rotations is not None and any(r is not None for r in rotations):
            keys = _rotate_padded(keys, rotations)
        shares = _padded_shares(meta, seqs, max_len, q.device)
        width = max(q_lens)
        # Row of each padded query slot within q (padding repeats a sequence's last query).
        first = torch.tensor([0, *q_lens[:-1]]).cumsum(0)
        slot = torch.arange(width)[None, :].clamp(max=torch.tensor(q_lens)[:, None] - 1)
        rows = (first[:, None] + slot).flatten().to(q.device)
        mask = torch.arange(max_len, device=q.device)[None, None, :] <= positions[rows].view(len(seqs), width, 1)
        out = _grouped_queries(q[rows].view(len(seqs), width, *q.shape[1:]), keys, values, mask[:, None], scale, shares)
        valid = (torch.arange(width)[None, :] < torch.tensor(q_lens)[:, None]).flatten().to(q.device)
        return out.flatten(0, 1)[valid]


def prefill_plan(meta: AttentionMetadata, device):
    """What the prefill kernel reads of a step, the same in every layer, so made once per step: the
    chunks it takes (prefill chunks, not APE's span share), their query rows (None: all of the
    step's), block tables, query starts, positions and context lengths, and their work (queries x
    keys); None if it takes none."""
    key = "prefill_plan"
    if key not in meta.derived:
        chunks = [i for i, q_len in enumerate(meta.query_lens)
                  if q_len > 1 and (meta.span_share is None or meta.span_share[i] is None)]
        plan = None
        if chunks:
            query_starts = torch.tensor([0, *(meta.query_lens[i] for i in chunks)]).cumsum(0)
            work = sum(meta.query_lens[i] * meta.context_lens[i] for i in chunks)
            if len(chunks) == len(meta.query_lens):  # the whole step (a sparse step: at every layer)
                plan = (chunks, None, meta.block_tables, query_starts, meta.positions, meta.context_lens_tensor, work)
            else:
                rows = _rows_of(chunks, list(accumulate(meta.query_lens, initial=0)), device)
                index = torch.tensor(chunks, device=meta.block_tables.device)
                plan = (chunks, rows, meta.block_tables[index].contiguous(), query_starts,
                        meta.positions[rows].contiguous(), torch.tensor([meta.context_lens[i] for i in chunks]), work)
        meta.derived[key] = plan
    return meta.derived[key]


def step_rotations(meta: AttentionMetadata, seqs: list[int]):
    """key_rotations of sequences `seqs`: the same in every layer, so made once per step (and kept
    in meta.derived for whoever reads the same step's keys: the focus probe's scores)."""
    if not meta.key_rotation:
        return None
    key = ("prefill_rotations", tuple(seqs))
    if key not in meta.derived:
        meta.derived[key] = key_rotations([meta.key_rotation[i] for i in seqs])
    return meta.derived[key]


def _rows_of(seqs: list[int], starts: list[int], device) -> torch.Tensor:
    """The query rows of sequences `seqs`, in order (starts: each sequence's first row)."""
    return torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(device)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, seqs: list[int], scale: float, rotations=None):
    """One query per sequence (rows of q in order) over its whole context. Every sequence's keys
    are gathered in one copy straight into head-major order, padded to the longest context
    ([B, kv_heads, L, D]), and attended by two batched matmuls and a masked softmax in the keys'
    dtype: 2.5x faster here than the flash kernel over the same padded keys, which converts
    them to float32 (the rounding is the prefill path's, _matmul_slice)."""
    num_seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if not any(rotations or ()) and not meta.span_share:  # the cache as it is: the C kernel reads it in place
        out = paged_decode(q, k_cache, v_cache, *decode_tables(meta, seqs), scale)
        if out is not None:
            return out
    rows, mask = _decode_rows(meta, seqs, k_cache.shape[1], kv_heads)
    length = mask.shape[-1]
    keys, values = _as_queries(q, *(torch.index_select(cache.view(-1, dim), 0, rows)
                                    .view(num_seqs, kv_heads, length, dim) for cache in (k_cache, v_cache)))
    for i, rotation in enumerate(rotations or ()):
        if rotation is not None:
            rotation.rotate_(keys[i], head_major=True)
    folded = (q * scale).view(num_seqs, kv_heads, heads // kv_heads, dim)  # head h = kv head h // groups
    scores = torch.matmul(folded, keys.transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
    shares = _padded_shares(meta, seqs, length, q.device)
    if shares is not None:
        _share_spans(scores, *shares)
    return torch.matmul(torch.softmax(scores, -1), values).view(num_seqs, heads, dim)


def _decode_rows(meta: AttentionMetadata, seqs: list[int], block_size: int, kv_heads: int):
    """_decode's gather rows (each sequence's head_major_rows, padded with its first key's) and
    its [B, 1, 1, L] mask of real keys: the same in every layer, so made once per step."""
    key = ("decode_rows", tuple(seqs))
    if key not in meta.derived:
        tables, lens = decode_tables(meta, seqs)
        length = int(lens.max())
        slots = _table_slots(tables, length, block_size)  # [B, L]
        real = torch.arange(length, device=lens.device)[None, :] < lens[:, None]
        slots = torch.where(real, slots, slots[:, :1])
        meta.derived[key] = (_slot_rows(slots, kv_heads).flatten(), real[:, None, None, :])
    return meta.derived[key]


def _as_queries(q: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Keys or values gathered from the cache in the queries' dtype (a bf16 cache under a float32
    model; no copy when they share it)."""
    return tuple(t.to(q.dtype) for t in tensors)


def store_kv(k_cache, v_cache, k, v, slot_mapping):
    """Write a step's keys and values to their slots, rounded to the cache's dtype if it is narrower."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(k_cache, v_cache, block_table, ctx_len, first_block=None):
    """Keys and values of one sequence's first ctx_len tokens, [ctx_len, kv_heads, D]."""
    num_blocks = -(-ctx_len // k_cache.shape[1])
    if first_block is not None:  # a contiguous run: a view, no copy
        blocks = slice(first_block, first_block + num_blocks)
        return k_cache[blocks].flatten(0, 1)[:ctx_len], v_cache[blocks].flatten(0, 1)[:ctx_len]
    blocks = block_table[:num_blocks]
    return (gather_blocks(k_cache, blocks).flatten(0, 1)[:ctx_len],
            gather_blocks(v_cache, blocks).flatten(0, 1)[:ctx_len])


def gather_head_major(k_cache, v_cache, block_table, ctx_len, first_block=None, rows=None):
    """Like gather_context, as contiguous copies in head-major order [kv_heads, ctx_len, D]:
    what a matmul over each head's keys reads without a copy of its own (one costs 2x more).
    Scattered blocks are gathered row by row straight into that order (`rows`, from
    head_major_rows): one copy instead of a gather and a transpose, 2x faster."""
    if first_block is not None:
        keys, values = gather_context(k_cache, v_cache, block_table, ctx_len, first_block)
        return _head_major(keys), _head_major(values)
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if rows is None:
        rows = head_major_rows(block_table, ctx_len, k_cache.shape[1], kv_heads)
    return (torch.index_select(k_cache.view(-1, dim), 0, rows).view(kv_heads, ctx_len, dim),
            torch.index_select(v_cache.view(-1, dim), 0, rows).view(kv_heads, ctx_len, dim))


def _step_rows(meta: AttentionMetadata, i: int, k_cache) -> torch.Tensor:
    """head_major_rows of sequence i: the same in every layer, so found once per step."""
    key = ("head_major_rows", i)
    if key not in meta.derived:
        meta.derived[key] = head_major_rows(meta.block_tables[i], meta.context_lens[i], *k_cache.shape[1:3])
    return meta.derived[key]


def head_major_rows(block_table, ctx_len: int, block_size: int, kv_heads: int) -> torch.Tensor:
    """[kv_heads * ctx_len]: where each (kv head, token) of a context is in a layer's cache
    viewed as one row per (slot, kv head), head by head."""
    return _slot_rows(_table_slots(block_table, ctx_len, block_size), kv_heads).flatten()


def _table_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[..., length]: the cache slots of the first `length` tokens of block tables [..., blocks]."""
    offsets = torch.arange(block_size, device=block_table.device)
    tables = block_table[..., : -(-length // block_size), None]
    return (tables * block_size + offsets).flatten(-2)[..., :length]


def _slot_rows(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[..., kv_heads, L]: the rows of slots [..., L] in a layer's cache viewed as one row per
    (slot, kv head)."""
    return slots.unsqueeze(-2) * kv_heads + torch.arange(kv_heads, device=slots.device)[:, None]


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """[L, kv_heads, D] as a contiguous [kv_heads, L, D] copy."""
    return x.transpose(0, 1).contiguous()


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache[table] for a block table of any shape; index_select is 2.5x faster than indexing."""
    return torch.index_select(cache, 0, table.flatten()).view(*table.shape, *cache.shape[1:])


def causal_mask(query_idx: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Each query sees the keys up to its own index."""
    key_idx = torch.arange(ctx_len, device=query_idx.device)
    return key_idx[None, :] <= query_idx[:, None]


def _matmul_attention(q, keys, values, positions, scale, share=None):
    """Queries q [Q, heads, D] over head-major keys/values [kv_heads, L, D], query i seeing the
    keys up to positions[i] (in any order: spans and CacheBlend's scattered tokens alike), slice
    by slice of queries so the scores stay small and a slice skips the keys after its last query
    (half the work of a causal prompt). `share`: APE's reweighting of span keys, if any."""
    rows = max(1, MATMUL_SLICE_SCORES // (q.shape[1] * keys.shape[1]))
    span, power = (share.mask(keys.shape[1]), share.power) if share is not None else (None, 1.0)
    if len(q) <= rows:
        return _matmul_slice(q, keys, values, positions, scale, span, power)
    out = torch.empty_like(q)
    for start in range(0, len(q), rows):
        part = slice(start, start + rows)
        end = int(positions[part].max()) + 1
        out[part] = _matmul_slice(q[part], keys[:, :end], values[:, :end], positions[part], scale,
                                  None if span is None else span[:end], power)
    return out


def fold_query_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries [T, heads, D] as their kv heads' rows, [kv_heads, groups * T, D] (query head g of a
    kv head owns rows g * T .. (g + 1) * T - 1), so grouped keys are read as they are."""
    num, heads, dim = q.shape
    return q.view(num, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)


def _matmul_slice(q, keys, values, positions, scale, span=None, power=1.0):
    """Scores, a masked softmax and the values, in the keys' dtype. In bf16 a score rounds to bf16
    where flash keeps float32: on the real model this moved logprobs no further from float32's
    than flash does (tests/test_attention.py), and float32 scores gave back much of the speed."""
    kv_heads, (num_q, heads, dim) = keys.shape[0], q.shape
    groups = heads // kv_heads
    folded = fold_query_heads(q * scale, kv_heads)
    scores = torch.matmul(folded, keys.transpose(1, 2))  # [kv_heads, groups * Q, L]
    first = int(positions.min())  # the keys before it are seen by every query
    if first + 1 < keys.shape[1]:
        hidden = torch.arange(first, keys.shape[1], device=q.device)[None, :] > positions[:, None]
        scores.view(kv_heads, groups, num_q, -1)[..., first:].masked_fill_(hidden, float("-inf"))
    if span is not None:
        _share_spans(scores, span, power)
    probs = torch.softmax(scores, -1)  # computed in float32, stored in the scores' dtype
    out = torch.matmul(probs, values)  # [kv_heads, groups * Q, D]
    return out.view(kv_heads, groups, num_q, dim).permute(2, 0, 1, 3).reshape(num_q, heads, dim)


def _share_spans(scores: torch.Tensor, span: torch.Tensor, power) -> None:
    """APE's scaling factor, in place on masked scores [..., L] whose span keys (`span`, [L] or
    broadcastable) already carry the temperature: each query's span-key scores get
    (power - 1) * log Z, Z the sum of their exps, so together they weigh Z ** power beside the
    other keys' plain weights. A query that sees no span key is left as it is."""
    log_z = torch.logsumexp(scores.float().masked_fill(~span, float("-inf")), -1, keepdim=True)
    log_z = torch.where(torch.isfinite(log_z), log_z, 0.0)
    scores.add_(torch.where(span, (power - 1) * log_z, 0.0).to(scores.dtype))


def _padded_shares(meta: AttentionMetadata, seqs: list[int], length: int, device):
    """The span shares of sequences `seqs` for keys padded to `length`: ([B, 1, 1, length] span
    masks, [B, 1, 1, 1] powers), or None if none of them has one."""
    shares = [meta.span_share[i] for i in seqs] if meta.span_share else []
    if not any(share is not None for share in shares):
        return None
    masks = torch.stack([s.mask(length) if s is not None else torch.zeros(length, dtype=torch.bool, device=device)
                         for s in shares])
    powers = torch.tensor([s.power if s is not None else 1.0 for s in shares], device=device)
    return masks[:, None, None, :], powers[:, None, None, None]


def _rotate_padded(keys: torch.Tensor, rotations) -> torch.Tensor:
    """Rotate [B, L, kv_heads, D] keys by each sequence's rotation; padding stays as is."""
    keys = keys.clone()
    for i, rotation in enumerate(rotations):
        if rotation is not None:
            rotation.rotate_(keys[i])
    return keys


def _single_query(q, k, v, scale, rotation=None):
    """One decode token attending to its whole context: no mask needed."""
    k = k if rotation is None else rotation.apply(k)
    return _grouped_queries(q[None], k[None], v[None], None, scale)[0]


def _grouped_queries(q, keys, values, mask, scale, shares=None):
    """Queries q [B, Q, heads, D] over keys/values [B, L, kv_heads, D], mask [B, 1, Q, L] or None:
    the query heads sharing a kv head become that head's query rows, so grouped keys are read as
    they are (no repeat, no float copy: 2x faster on CPU than expanding them to float32).
    `shares` (from _padded_shares): APE's reweighting, computed with explicit scores."""
    num_seqs, width, heads, dim = q.shape
    kv_heads = keys.shape[2]
    groups = heads // kv_heads
    folded = q.view(num_seqs, width, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(
        num_seqs, kv_heads, groups * width, dim)
    if mask is not None and width > 1:
        mask = mask[:, :, None].expand(num_seqs, 1, groups, width, mask.shape[-1]).reshape(
            num_seqs, 1, groups * width, mask.shape[-1])
    if shares is None:
        out = F.scaled_dot_product_attention(folded, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(folded * scale, keys.permute(0, 2, 3, 1))  # [B, kv_heads, groups * Q, L]
        scores.masked_fill_(~mask, float("-inf"))
        _share_spans(scores, *shares)
        out = torch.matmul(torch.softmax(scores, -1), values.transpose(1, 2))
    return out.view(num_seqs, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4).reshape(q.shape)


def _sdpa(q, k, v, mask, scale, causal=False):
    # [T, H, D] -> [1, H, T, D]: with a batch dimension the CPU flash kernel runs (5x faster
    # than the 3-D path here); grouped-query heads are expanded by the kernel.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def key_rotations(rotations: list[KeyRotation | None]) -> tuple[torch.Tensor, ...] | None:
    """paged_prefill's `rotations` for sequences whose first keys move by these KeyRotations (None:
    none move): where each sequence's keys start among all moved keys, each moved key's row in one
    table of distinct angles, and that table (cos, sin). None if none move."""
    if all(r is None for r in rotations):
        return None
    lens = [len(r) if r is not None else 0 for r in rotations]
    starts = torch.tensor([0, *lens]).cumsum(0)
    ids, cos, sin, rows = [], [], [], 0
    for rotation in filter(None, rotations):
        key_ids, key_cos, key_sin = rotation.distinct_angles()
        ids.append(key_ids + rows)
        cos.append(key_cos)
        sin.append(key_sin)
        rows += len(key_cos)
    return starts, torch.cat(ids).int().contiguous(), *(torch.cat(t).float().contiguous() for t in (cos, sin))
