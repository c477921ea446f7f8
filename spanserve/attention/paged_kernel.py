"""Paged attention in one Triton kernel: flash attention over a paged KV cache, for any mix of
prefill chunks and decode tokens, with cached keys moved to new positions on the fly.

Each program takes one tile of query rows of one sequence and one KV head. A row is a (query
token, query head) pair of that KV head's group, so grouped-query heads share every key and
value load and a decode token's heads fill the tile's rows instead of padding. Row r of a
sequence is token r // G, head kv_head * G + r % G. A query sees the keys up to its position.

Keys j < rot_len of a sequence move by rot_deltas[j] positions before use (position-
independent spans, pic/layout.py): the same rotation as KeyRotation, computed from the rotary
tables in float32, so shared span blocks are never rewritten. A third grid axis splits the keys
(flash decoding) when too few tiles would leave the GPU idle; the splits' partial results are
merged by `merge_splits`.

Imported only where Triton is installed (see triton_paged.py).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    Q, K, V, Out, PartAcc, PartMax, PartSum,
    tile_seq, tile_row, q_starts, q_lens, ctx_lens, positions, block_tables,
    rot_lens, rot_deltas, cos_table, sin_table,
    scale, num_splits,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh,
    stride_bt, stride_rot, stride_ps,
    GROUP: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROTATE: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,  # float32 inputs: 'ieee' (exact products), not TF32
):
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    q_start, ctx_len = tl.load(q_starts + seq), tl.load(ctx_lens + seq)
    rows = tl.load(tile_row + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(q_lens + seq) * GROUP
    token = q_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    pos = tl.load(positions + token, mask=row_ok, other=-1).to(tl.int32)

    dims = tl.arange(0, 2 * HALF)
    q_ptr = Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)

    # This split's share of the keys any row of the tile sees, in whole BLOCK_N steps.
    key_end = tl.minimum(ctx_len, tl.max(pos, 0) + 1)
    per_split = tl.cdiv(tl.cdiv(key_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(key_end, start + per_split)
    rot_len = tl.load(rot_lens + seq) if ROTATE else 0
    # rotate-half: dimension d pairs with d + HALF (mod head_dim); the first half takes -sin
    partner = (dims + HALF) % (2 * HALF)
    sin_sign = tl.where(dims < HALF, -1.0, 1.0)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * HALF], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 below
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        page = tl.load(block_tables + seq * stride_bt + keys // PAGE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * stride_kb + (keys % PAGE) * stride_kt + kv_head * stride_kh
        k = tl.load(K + slot[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        if ROTATE:
            moved = key_ok & (keys < rot_len)
            delta = tl.load(rot_deltas + seq * stride_rot + keys, mask=moved, other=0)
            angle = tl.abs(delta)[:, None] * HALF + (dims % HALF)[None, :]
            cos = tl.load(cos_table + angle)
            sin = tl.load(sin_table + angle) * tl.where(delta < 0, -1.0, 1.0)[:, None] * sin_sign[None, :]
            paired = tl.load(K + slot[:, None] + partner[None, :], mask=key_ok[:, None], other=0.0)
            k = (k.to(tl.float32) * cos + paired.to(tl.float32) * sin).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        seen = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        scores = tl.where(seen, scores * qk_scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        decay = tl.exp2(row_max - safe_max)
        row_sum = row_sum * decay + tl.sum(probs, 1)
        values = tl.load(V + slot[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * decay[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        row_max = new_max

    if SPLIT:
        # Partial results are laid out like Out ([T, H, D], contiguous) behind a split axis; the
        # max and sum arrays are the accumulator's without its last axis.
        part = split * stride_ps + token * stride_ot + head * stride_oh
        tl.store(PartMax + part // (2 * HALF), row_max, mask=row_ok)
        tl.store(PartSum + part // (2 * HALF), row_sum, mask=row_ok)
        tl.store(PartAcc + part[:, None] + dims[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        out_ptr = Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def merge_splits_kernel(PartAcc, PartMax, PartSum, Out, num_splits, heads, stride_ot, stride_oh, stride_ps,
                        DIM: tl.constexpr, SPLITS: tl.constexpr):
    """One (token, head) row: its splits' partial results weighted by exp2(their max - the top)."""
    row = tl.program_id(0)
    token, head = row // heads, row % heads
    splits = tl.arange(0, SPLITS)
    ok = splits < num_splits
    row_max = tl.load(PartMax + splits * (stride_ps // DIM) + row, mask=ok, other=float("-inf"))
    top = tl.max(row_max, 0)
    weight = tl.exp2(row_max - tl.where(top == float("-inf"), 0.0, top))  # a split that saw no key: 0
    total = tl.sum(tl.load(PartSum + splits * (stride_ps // DIM) + row, mask=ok, other=0.0) * weight, 0)
    dims = tl.arange(0, DIM)
    acc = tl.load(PartAcc + (splits * stride_ps + row * DIM)[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
    merged = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + token * stride_ot + head * stride_oh + dims, merged.to(Out.dtype.element_ty))


def merge_splits(acc: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor, out: torch.Tensor) -> None:
    """Combine the splits' partial softmax results (acc [S, T, H, D], max and sum [S, T, H],
    maxima in log2 units, all contiguous) into out [T, H, D], one launch for every row."""
    splits, tokens, heads, dim = acc.shape
    merge_splits_kernel[(tokens * heads,)](
        acc, row_max, row_sum, out, splits, heads, out.stride(0), out.stride(1), tokens * heads * dim,
        DIM=dim, SPLITS=triton.next_power_of_2(splits), num_warps=1,
    )
