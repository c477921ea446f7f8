"""A layer's RMSNorm, silu(gate) * up and RoPE with the cache store in one C call each
(kernels/csrc/layer_ops.c) against the torch code they stand in for, and the cases that keep the torch path."""

import pytest
import torch
import torch.nn.functional as F

from spanserve.attention.torch_ref import store_kv
from spanserve.kernels import cpu_kernel
from spanserve.models import layer_ops
from spanserve.models.rope import RotaryEmbedding

needs_kernel = pytest.mark.skipif(cpu_kernel.load("layer") is None, reason="no C compiler: the kernel is not built")


def torch_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 9, 64), (700, 96), (2, 1500)])
def test_rms_norm_equals_the_torch_formula(shape):
    """float32 within float32 rounding (the sums run in another order); bf16 exactly, as the
    rounding steps are the same (norm in float32, cast, product rounded to bf16)."""
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x32, w32 = torch.randn(shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            x, w = x32.to(dtype), w32.to(dtype)
            out, expected = layer_ops.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6)
            assert out.dtype == dtype and out.shape == x.shape
            if dtype == torch.float32:
                torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(out, expected)


@needs_kernel
def test_rms_norm_reads_a_strided_view():
    """Qwen3's q_norm runs on a head view of the qkv projection's output (not contiguous)."""
    qkv = torch.randn(5, 3 * 64)
    q = qkv[:, :128].view(5, 2, 64)
    w = torch.randn(64)
    with torch.inference_mode():
        torch.testing.assert_close(layer_ops.rms_norm(q, w, 1e-5), torch_rms_norm(q, w, 1e-5), rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("rows, width", [(1, 1536), (8, 1536), (300, 64), (3, 5000)])
def test_silu_mul_equals_the_torch_formula(rows, width):
    """float32 within its rounding; bf16 within two bf16 steps where silu's float32 value, computed
    with another exp, rounds the other way before the product rounds again (rare)."""
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    gate_up[0, :3] = torch.tensor([-120.0, 0.0, 90.0])  # e^-x far past float32's range either way
    with torch.inference_mode():
        out = layer_ops.silu_mul(gate_up)
        torch.testing.assert_close(out, torch_silu_mul(gate_up), rtol=1e-6, atol=1e-6)
        bf16 = gate_up.bfloat16()
        out, expected = layer_ops.silu_mul(bf16), torch_silu_mul(bf16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, width)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-6, atol=1e-6)
    assert (out != expected).float().mean() < 0.01


def test_with_gradients_the_torch_path_runs():
    """Training a plug-in backpropagates through the norms and the MLP: no C call there."""
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    out = layer_ops.rms_norm(x, w, 1e-5) + layer_ops.silu_mul(torch.cat([x, x], -1))
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_spanserve_cpu_kernels_without_layer_keeps_the_torch_ops(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_tried", True)
    monkeypatch.setattr(cpu_kernel, "_allowed", frozenset({"decode", "prefill"}))
    x, w = torch.randn(3, 40), torch.randn(40)
    with torch.inference_mode():
        assert torch.equal(layer_ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5))
        assert torch.equal(layer_ops.silu_mul(torch.cat([x, w.expand(3, 40)], -1)),
                           torch_silu_mul(torch.cat([x, w.expand(3, 40)], -1)))


def _rope_case(dtype, kv_dtype, tokens=5, heads=9, kv_heads=3, dim=64, seed=0):
    """A qkv projection's output split into views, a rope, a cache and distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    rope = RotaryEmbedding(dim, 4096, 10000.0, {})
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cache = torch.randn(2, 6, 16, kv_heads, dim, generator=gen).to(kv_dtype)
    slots = torch.randperm(6 * 16, generator=gen)[:tokens]
    return rope, positions, q, k, v, cache, slots


@needs_kernel
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("tokens", [1, 8, 700])
def test_rope_store_equals_rope_then_store(dtype, kv_dtype, tokens):
    """Rotated q and k as RotaryEmbedding computes them (bf16: exactly, the same rounding steps),
    and the cache's slots as store_kv writes them; the other slots untouched."""
    rope, positions, q, k, v, cache, slots = _rope_case(dtype, kv_dtype, tokens=min(tokens, 96), seed=tokens)
    expected_cache = cache.clone()
    with torch.inference_mode():
        q_ref, k_ref = rope(positions, q, k)
        store_kv(expected_cache[0], expected_cache[1], k_ref, v, slots)
        q_out, k_out, stored = layer_ops.rope_store(rope, positions, q, k, v, cache, slots)
    assert stored and q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (cache, expected_cache)):
        if dtype == torch.bfloat16:
            assert torch.equal(out, ref)
        else:  # float32: a product and a sum may fuse into one rounding, which may tip a bf16 cache's
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-6 if out.dtype == dtype else 2**-7, atol=1e-5)
            assert out.dtype == dtype or (out != ref).float().mean() < 0.01


@needs_kernel
def test_rope_store_reads_normed_keys_beside_a_value_view():
    """Qwen3's q and k norms make q and k new tensors while v stays a view of the projection."""
    rope, positions, q, k, v, cache, slots = _rope_case(torch.float32, torch.float32)
    q, k = q.contiguous() * 0.5, k.contiguous() * 0.5
    expected = cache.clone()
    with torch.inference_mode():
        q_ref, k_ref = rope(positions, q, k)
        store_kv(expected[0], expected[1], k_ref, v, slots)
        q_out, k_out, stored = layer_ops.rope_store(rope, positions, q, k, v, cache, slots)
    assert stored
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(cache, expected, rtol=1e-6, atol=1e-5)


@needs_kernel
def test_rope_store_refuses_a_slot_or_position_out_of_range():
    rope, positions, q, k, v, cache, slots = _rope_case(torch.float32, torch.float32)
    before = cache.clone()
    with torch.inference_mode():
        for bad_positions, bad_slots in ((positions, slots + 6 * 16), (positions + 4096, slots)):
            with pytest.raises(RuntimeError, match="rope_store failed"):
                layer_ops.rope_store(rope, bad_positions, q, k, v, cache, bad_slots)
    assert torch.equal(cache, before)  # checked before anything is written


def test_rope_store_without_a_cache_or_the_kernel_leaves_the_store_to_the_backend(monkeypatch):
    rope, positions, q, k, v, cache, slots = _rope_case(torch.float32, torch.float32)
    before = cache.clone()
    with torch.inference_mode():
        q_ref, k_ref = rope(positions, q, k)
        for cache_arg in (None, cache):
            if cache_arg is cache:
                monkeypatch.setattr(cpu_kernel, "_tried", True)
                monkeypatch.setattr(cpu_kernel, "_allowed", frozenset({"decode", "prefill"}))
            q_out, k_out, stored = layer_ops.rope_store(rope, positions, q, k, v, cache_arg, slots)
            assert not stored and torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(cache, before)
