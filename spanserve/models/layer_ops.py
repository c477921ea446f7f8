"""A decoder layer's elementwise ops, RMSNorm and SwiGLU's silu(gate) * up, in one C call each on
CPU (csrc/layer_ops.c) and one Triton kernel each on CUDA (triton_layer_ops.py).

In torch each is a chain of small ops, and in a decode step of a few rows every op costs its
dispatch rather than its arithmetic: the 61 RMSNorms of SmolLM2 took about 4 ms of a 41 ms step
of 8 sequences (torch profiler). The torch formulas below stay the reference, with the same
rounding as the C path, and the path for other devices and dtypes, for autograd (training a
plug-in), and wherever the C library is not built or SPANSERVE_CPU_KERNELS leaves out `layer`.
"""

import torch
import torch.nn.functional as F

from spanserve.kernels import cpu_kernel, native
from spanserve.kernels.gpu import triton_available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension: normalized in float32, cast to x's dtype, then
    scaled in that dtype (as transformers does)."""
    if gpu := _gpu_kernels(x, weight):
        return gpu.rms_norm(x, weight, eps)
    kernel = _kernel(x, weight)
    if kernel is None:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)
    x = x.contiguous()
    out = torch.empty_like(x)
    status = kernel.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                             eps, native.DTYPES[x.dtype])
    _raise_on(status, "rms_norm", x)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dimension, silu in float32 cast to the
    dtype first (as torch computes it)."""
    if gpu := _gpu_kernels(gate_up, gate_up):
        return gpu.silu_mul(gate_up)
    kernel = _kernel(gate_up, gate_up)
    if kernel is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype)
    status = kernel.silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], width,
                             native.DTYPES[gate_up.dtype])
    _raise_on(status, "silu_mul", gate_up)
    return out


def rope_store(rope, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor,
               tables=None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """q and k rotated to `positions` by `rope` (a RotaryEmbedding), and whether k and v are in the
    cache already: the C call rotates both and writes the cache slots in one pass (a decode layer's
    RoPE and cache store were about 12 torch ops); elsewhere `rope` rotates them (its `tables`
    made once per step) and the attention backend stores them."""
    cos, sin = rope.cos, rope.sin
    kernel = _kernel(q, q) if _rope_store_fits(cos, sin, q, k, v, kv_cache) else None
    if kernel is None:
        q, k = rope(positions, q, k, tables)
        return q, k, False
    tokens, heads, dim = q.shape
    # (empty_like: torch.empty(shape, dtype=...) takes twice as long to parse its arguments)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    positions, slots = positions.long().contiguous(), slot_mapping.long().contiguous()
    keys = kv_cache.data_ptr()  # then the values: [num_slots, kv_heads, dim] each
    values = keys + kv_cache.stride(0) * kv_cache.element_size()
    status = kernel.rope_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
                               positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                               q_out.data_ptr(), k_out.data_ptr(), keys, values,
                               slots.data_ptr(), kv_cache.shape[1] * kv_cache.shape[2], tokens, heads, k.shape[1], dim,
                               native.DTYPES[q.dtype], native.DTYPES[kv_cache.dtype])
    _raise_on(status, "rope_store", q)
    return q_out, k_out, True


def _rope_store_fits(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: torch.Tensor | None) -> bool:
    """Whether rope_store's C call can take these: a CPU cache it reads, float32 tables (cos, sin)
    of half a head, and heads whose values are contiguous in rows (the views a qkv projection
    splits into). Checked at every layer of every step: written out, not looped."""
    return (kv_cache is not None and kv_cache.device.type == "cpu" and kv_cache.dtype in native.DTYPES
            and kv_cache.is_contiguous() and cos.dtype == torch.float32 and cos.is_contiguous()
            and sin.is_contiguous() and 2 * cos.shape[-1] == q.shape[-1]
            and k.dtype == v.dtype == q.dtype
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and q.stride(-2) == q.shape[-1] and k.stride(-2) == k.shape[-1] and v.stride(-2) == v.shape[-1])


def _gpu_kernels(x: torch.Tensor, weight: torch.Tensor):
    """The Triton kernels (triton_layer_ops.py), where they may run these tensors: on CUDA with
    Triton installed, one dtype, no gradient to record."""
    if x.device.type != "cuda" or weight.dtype != x.dtype or not triton_available() or records_grad(x, weight):
        return None
    from spanserve.models import triton_layer_ops

    return triton_layer_ops


def _kernel(x: torch.Tensor, weight: torch.Tensor):
    """The C library, where it may run these tensors: on CPU, in a dtype it reads, with no
    gradient to record."""
    if x.device.type != "cpu" or x.dtype not in native.DTYPES or weight.dtype != x.dtype or x.numel() == 0:
        return None
    if records_grad(x, weight):
        return None
    return cpu_kernel.load("layer")


def records_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Autograd would record an op of x and weight (training a plug-in): only torch may run it."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def _raise_on(status: int, name: str, x: torch.Tensor) -> None:
    if status != 0:  # -1 shapes, -3 out of memory
        raise RuntimeError(f"{name} failed ({status}) for {tuple(x.shape)} {x.dtype}")
