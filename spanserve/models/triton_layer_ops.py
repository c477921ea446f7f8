"""RMSNorm and SwiGLU's silu(gate) * up as one Triton kernel each, for CUDA (layer_ops.py picks
them). In torch each is a chain of small kernels: in a batch-1 decode step of the 8B shape on
an H100, the elementwise kernels around the matmuls took about 3 of its 8 ms (torch profiler).
Same rounding as layer_ops' torch formulas. Imported only where Triton is installed."""

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns of silu(gate) * up per program


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, 0) / width + eps)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, normed * tl.load(W + cols, mask=ok, other=0.0), mask=ok)


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_g, stride_o, width, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(GateUp + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + width + cols, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Out + row * stride_o + cols, silu * up, mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the row, as the kernels read it."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), rows.shape[1], eps,
                                           BLOCK=triton.next_power_of_2(rows.shape[1]), num_warps=8)
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, SILU_BLOCK))](
            rows, out, rows.stride(0), out.stride(0), width, BLOCK=SILU_BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], width)
