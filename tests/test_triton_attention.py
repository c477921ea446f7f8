"""The Triton paged-attention kernel against the torch reference, on one mixed step: prefill
chunks over earlier context, decode tokens, span-like scattered queries, moved span keys and
scattered blocks, with and without split keys.

Runs on CUDA; without a GPU it is skipped, unless TRITON_INTERPRET=1 (Triton's CPU interpreter,
slow but exact) is set where Triton is installed."""

import pytest
import torch
from helpers import triton_device

from spanserve.attention import AttentionMetadata, KeyRotation, TorchAttention
from spanserve.models.rope import RotaryEmbedding

DEVICE = triton_device()
INTERPRET = DEVICE.type == "cpu"

from spanserve.attention.triton_paged import TritonAttention, plan_step  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 8, 2, 64, 16
# (context length, query positions, keys moved): a prefill chunk over earlier context, a decode
# token over moved span keys, span-like queries that skip ahead, a short decode, a whole prompt
SEQUENCES = [
    (120, list(range(80, 120)), 0),
    (300, [299], 200),
    (190, [100, 101, 102, 160, 161, 189], 150),
    (5, [4], 0),
    (70, list(range(70)), 0),
]


def _step(dtype):
    torch.manual_seed(0)
    num_blocks = sum(-(-n // BS) for n, _, _ in SEQUENCES) + 3
    cache = torch.randn(2, num_blocks, BS, KV_HEADS, DIM, device=DEVICE).to(dtype)
    free = torch.randperm(num_blocks - 1).tolist()  # scattered blocks, never block 0's order
    rope = RotaryEmbedding(DIM, 4096, 10000.0, {}).to(DEVICE)
    tables, slots, positions, rotations = [], [], [], []
    for n, pos, moved in SEQUENCES:
        table = [free.pop() + 1 for _ in range(-(-n // BS))]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in pos]
        positions += pos
        rotations.append(_rotation(rope, moved) if moved else None)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), query_lens=[len(p) for _, p, _ in SEQUENCES],
        context_lens=[n for n, _, _ in SEQUENCES],
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE),
        context_lens_tensor=torch.tensor([n for n, _, _ in SEQUENCES], device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE), key_rotation=rotations,
    )
    q = torch.randn(len(positions), HEADS, DIM, device=DEVICE).to(dtype)
    k = torch.randn(len(positions), KV_HEADS, DIM, device=DEVICE).to(dtype)
    v = torch.randn(len(positions), KV_HEADS, DIM, device=DEVICE).to(dtype)
    return q, k, v, cache, meta


def _rotation(rope, moved: int) -> KeyRotation:
    """Keys 0..moved-1 move by random deltas of either sign, as the runner builds it."""
    deltas = torch.randint(-500, 500, (moved,), device=DEVICE)
    sign = deltas.sign().unsqueeze(-1).float()
    return KeyRotation(rope.cos[deltas.abs()], sign * rope.sin[deltas.abs()], KV_HEADS,
                       deltas.to(torch.int32), (rope.cos, rope.sin))


DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])  # numpy has no bf16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])  # 3: a split count no power of two
def test_kernel_step_equals_the_torch_reference(dtype, splits):
    q, k, v, cache, meta = _step(dtype)
    scale = DIM**-0.5
    ref_cache = cache.clone()
    expected = TorchAttention().forward(q, k, v, ref_cache, meta, scale)
    backend = TritonAttention()
    plan = plan_step(meta, HEADS // KV_HEADS, KV_HEADS, DEVICE)
    plan.num_splits = splits
    meta.derived["kernel_plan"] = plan
    got_cache = cache.clone()
    got = backend.forward(q, k, v, got_cache, meta, scale)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)  # the new keys and values stored
    # bf16 inputs, float32 accumulation in both: the gap is the rounding of probabilities and
    # rotated keys to bf16 before their products, far below one attention weight's size
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert (got.float() - expected.float()).abs().mean() < tol / 5


def test_rotation_in_the_kernel_is_not_a_no_op():
    """The same step without its rotations gives other outputs for the moved sequences only."""
    q, k, v, cache, meta = _step(DTYPES[-1])
    backend, scale = TritonAttention(), DIM**-0.5
    moved = backend.forward(q, k, v, cache.clone(), meta, scale)
    meta.key_rotation, meta.derived = None, {}
    still = backend.forward(q, k, v, cache.clone(), meta, scale)
    rows = torch.tensor([0, *torch.tensor([len(p) for _, p, _ in SEQUENCES]).cumsum(0).tolist()])
    for i, (_, _, keys_moved) in enumerate(SEQUENCES):
        differs = (moved[rows[i]:rows[i + 1]] - still[rows[i]:rows[i + 1]]).abs().max() > 0.05
        assert bool(differs) == bool(keys_moved)
