"""TritonAttention: the CUDA backend, one paged-attention kernel (paged_kernel.py) per layer
for the whole flat batch, span keys rotated inside the kernel.

Per step, the batch's layout becomes a KernelPlan once (tiles of query rows, lengths, the
rotation deltas) and every layer reuses it. A CUDA graph of the decode step keeps a plan of its
own whose tensors it refills in place (engine/cuda_graphs.py). Sequences whose queries reweight
span keys (APE) take the torch reference: the kernel has no pre-softmax hook.
"""

from dataclasses import dataclass

import numpy as np
import torch

from spanserve.attention.backend import AttentionBackend, AttentionMetadata
from spanserve.attention.torch_ref import TorchAttention, store_kv

BLOCK_N = 64  # keys per kernel iteration (four 16-token pages)
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32


@dataclass
class KernelPlan:
    """One step's batch layout, as the kernel reads it (int32 tensors on the GPU)."""

    tile_seq: torch.Tensor  # [tiles] sequence of each tile
    tile_row: torch.Tensor  # [tiles] its first row (token * group + head) in the sequence
    q_starts: torch.Tensor  # [B] first row of each sequence in the flat batch
    q_lens: torch.Tensor  # [B]
    ctx_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    positions: torch.Tensor  # [T] each query's position (the last key it sees)
    rot_lens: torch.Tensor | None  # [B] keys to move (0: none), None if no sequence moves any
    rot_deltas: torch.Tensor | None  # [B, max rot_len]
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None
    block_m: int
    num_splits: int


def plan_step(meta: AttentionMetadata, group: int, kv_heads: int, device: torch.device) -> KernelPlan:
    """The kernel's view of an eager step's metadata; small arrays go over in one copy."""
    q_lens, ctx_lens = np.asarray(meta.query_lens), np.asarray(meta.context_lens)
    rows = q_lens * group
    block_m = 16 if rows.max() <= 16 else 64
    per_seq = -(-rows // block_m)
    tile_seq = np.repeat(np.arange(len(rows)), per_seq)
    tile_row = (np.arange(len(tile_seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * block_m
    q_starts = np.cumsum(q_lens) - q_lens
    packed = torch.from_numpy(np.concatenate([tile_seq, tile_row, q_starts, q_lens, ctx_lens]).astype(np.int32))
    sizes = [len(tile_seq)] * 2 + [len(rows)] * 3
    tile_seq_t, tile_row_t, q_starts_t, q_lens_t, ctx_lens_t = packed.to(device, non_blocking=True).split(sizes)
    rot_lens, rot_deltas, tables = _rotations(meta, device)
    return KernelPlan(tile_seq_t, tile_row_t, q_starts_t, q_lens_t, ctx_lens_t, meta.block_tables,
                      meta.positions, rot_lens, rot_deltas, tables, block_m,
                      num_splits(len(tile_seq) * kv_heads, int(ctx_lens.max()), device))


def num_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Split the keys when the tiles alone would fill less than two waves of the GPU."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // programs), max_context // MIN_KEYS_PER_SPLIT))


def _rotations(meta: AttentionMetadata, device):
    rotations = meta.key_rotation or []
    moving = [r for r in rotations if r is not None]
    if not moving:
        return None, None, None
    lengths = [len(r) if r is not None else 0 for r in rotations]
    deltas = torch.zeros(len(rotations), max(lengths), dtype=torch.int32, device=device)
    for i, r in enumerate(rotations):
        if r is not None:
            deltas[i, : len(r)] = r.deltas
    return torch.tensor(lengths, dtype=torch.int32, device=device), deltas, moving[0].rope_tables


class TritonAttention(AttentionBackend):
    def __init__(self):
        from spanserve.attention import paged_kernel  # needs Triton: imported only when chosen

        self.kernel = paged_kernel
        self.reference = TorchAttention()

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, stored: bool = False):
        if not kernel_handles(meta, q.shape[-1]):
            return self.reference.forward(q, k, v, kv_cache, meta, scale, stored)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if not stored:
            store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        plan = meta.derived.get("kernel_plan")
        if plan is None:
            plan = meta.derived["kernel_plan"] = plan_step(meta, q.shape[1] // k.shape[1], k.shape[1], q.device)
        return self.attend(q, k_cache, v_cache, plan, scale)

    def attend(self, q, k_cache, v_cache, plan: KernelPlan, scale: float) -> torch.Tensor:
        """q [T, heads, D] over the paged cache as `plan` lays the batch out."""
        num_tokens, heads, dim = q.shape
        kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        out = torch.empty_like(q)
        split = plan.num_splits > 1
        if split:
            acc = torch.empty(plan.num_splits, num_tokens, heads, dim, dtype=torch.float32, device=q.device)
            row_max = torch.empty(plan.num_splits, num_tokens, heads, dtype=torch.float32, device=q.device)
            row_sum = torch.empty_like(row_max)
        else:
            acc = row_max = row_sum = out  # unused
        rotate = plan.rot_lens is not None
        rot_lens, rot_deltas = (plan.rot_lens, plan.rot_deltas) if rotate else (plan.ctx_lens, plan.ctx_lens)
        cos, sin = plan.rope_tables if rotate else (out, out)
        grid = (len(plan.tile_seq), kv_heads, plan.num_splits)
        self.kernel.paged_attention_kernel[grid](
            q, k_cache, v_cache, out, acc, row_max, row_sum,
            plan.tile_seq, plan.tile_row, plan.q_starts, plan.q_lens, plan.ctx_lens, plan.positions,
            plan.block_tables, rot_lens, rot_deltas, cos, sin,
            scale, plan.num_splits,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1), plan.block_tables.stride(0),
            rot_deltas.stride(0) if rotate else 0, num_tokens * heads * dim,
            GROUP=heads // kv_heads, HALF=dim // 2, PAGE=page, BLOCK_M=plan.block_m, BLOCK_N=BLOCK_N,
            ROTATE=rotate, SPLIT=split, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=2,
        )
        if split:
            self.kernel.merge_splits(acc, row_max, row_sum, out)
        return out


def kernel_handles(meta: AttentionMetadata, head_dim: int) -> bool:
    """APE's span weighting, rotations with extra factors and head sizes that are no power of
    two (or under 16, a tensor-core product's least) are the reference's alone."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    if meta.span_share is not None and any(s is not None for s in meta.span_share):
        return False
    return not meta.key_rotation or all(r is None or r.deltas is not None for r in meta.key_rotation)
