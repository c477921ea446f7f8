"""The Triton RMSNorm and silu(gate) * up (models/triton_layer_ops.py) against the torch formulas
of layer_ops.py, and picked by layer_ops on CUDA. Runs on CUDA, or under TRITON_INTERPRET=1."""

import pytest
import torch
import torch.nn.functional as F
from helpers import triton_device

from spanserve.models import layer_ops

DEVICE = triton_device()
from spanserve.models import triton_layer_ops  # noqa: E402  (needs Triton)

DTYPES = [torch.float32, torch.float16] + ([] if DEVICE.type == "cpu" else [torch.bfloat16])  # numpy has no bf16
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}  # one rounding of the result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 4096), (0, 64)])
def test_rms_norm_equals_the_torch_formula(dtype, shape):
    torch.manual_seed(0)
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)
    weight = torch.randn(shape[-1], device=DEVICE).to(dtype)
    x32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    got = triton_layer_ops.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, weight * x32.to(dtype), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 96), (1, 2 * 2500), (0, 64)])
def test_silu_mul_equals_the_torch_formula(dtype, shape):
    torch.manual_seed(1)
    gate_up = (4 * torch.randn(shape, device=DEVICE)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = triton_layer_ops.silu_mul(gate_up)
    assert got.shape == up.shape and got.dtype == dtype
    torch.testing.assert_close(got, F.silu(gate) * up, atol=TOL[dtype], rtol=TOL[dtype])


def test_layer_ops_pick_the_triton_kernels_on_cuda_only_without_gradients():
    x, weight = torch.randn(3, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    assert (layer_ops._gpu_kernels(x, weight) is triton_layer_ops) == (DEVICE.type == "cuda")
    assert layer_ops._gpu_kernels(x, weight.requires_grad_()) is None
    assert layer_ops._gpu_kernels(x, weight.detach().half()) is None
