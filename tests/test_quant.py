"""Weight-only int8 and int4 (quantization="int8" / "int4"): the kernel paths compute the
dequantized weights' product, the engine with either equals an engine holding those dequantized
weights, and what cannot run is refused at start."""

import pytest
import torch
import torch.nn.functional as F
from helpers import greedy, random_prompt
from torch import nn

from spanserve import LLM, InvalidRequestError
from spanserve.kernels import cpu_kernel
from spanserve.models import layout, quant


@pytest.fixture(params=["c", "torch"])
def int8_kernel(request, monkeypatch):
    """Int8Linear's two kernels for few rows: spanserve's C GEMM (when built), or torch's packed
    kernel, which it falls back to without that library."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernel, "_tried", True)
        monkeypatch.setattr(cpu_kernel, "_allowed", frozenset({"decode", "prefill", "layer"}))
    elif cpu_kernel.load("gemm") is None:
        pytest.skip("spanserve's C library is not built here")
    return request.param


# x holds 2 x rows rows: a kernel up to its row limit, the GEMM beyond ("limit": just at it, "past":
# one row pair past it); 200 input channels leave a partial slice of the C kernel's 128, 70 output
# channels pad its last tile of 48, 9 rows (18) step past its 8
@pytest.mark.parametrize("rows", [1, 3, 9, "limit", "past"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_computes_the_dequantized_product(rows, dtype, int8_kernel):
    torch.manual_seed(0)
    limit = layout.PACKED_MAX_ROWS if int8_kernel == "c" else quant.TORCH_PACKED_MAX_ROWS
    rows = {"limit": limit // 2, "past": limit // 2 + 1}.get(rows, rows)
    linear = nn.Linear(200, 70, bias=True).to(dtype)
    q = quant.Int8Linear(linear)
    assert (q.kernel is not None) == (int8_kernel == "c")
    x = torch.randn(2, rows, 200).to(dtype)
    dequantized = q.int8_weight().float() * q.scale.float()[:, None]
    expected = x.float() @ dequantized.t() + linear.bias.float()
    # torch's kernel reads bf16 activations, for a float32 model too (quant.kernel_dtype); the C
    # one float32, so a float32 model gets float32's rounding there
    exact = int8_kernel == "c" and dtype == torch.float32 and 2 * rows <= limit
    tol = 1e-5 if exact else 3e-2
    torch.testing.assert_close(q(x).float(), expected, atol=tol, rtol=tol)
    weight = linear.weight.float()  # each row within a step of its grid (127 steps to its largest entry)
    assert ((dequantized - weight).abs().amax(1) <= 0.01 * weight.abs().amax(1)).all()


# x holds 2 x rows rows: the packed kernel up to INT4_PACKED_MAX_ROWS, the GEMM beyond
@pytest.mark.parametrize("rows", [1, quant.INT4_PACKED_MAX_ROWS // 2, quant.INT4_PACKED_MAX_ROWS // 2 + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_computes_the_dequantized_product(rows, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)  # 40 rows: padded to the layout's 64
    q = quant.Int4Linear(linear)
    x = torch.randn(2, rows, 96).to(dtype)
    dequantized = q.dequantized().float()
    expected = x.float() @ dequantized.t() + linear.bias.float()
    tol = 3e-2  # the kernel reads bf16 activations, for a float32 model too (quant.kernel_dtype)
    torch.testing.assert_close(q(x).float(), expected, atol=tol, rtol=tol)
    groups = linear.weight.float().view(40, -1, quant.INT4_GROUP)  # each weight within half a step of 15
    steps = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    rounding = 2**-8 * groups.abs().amax(-1, keepdim=True)  # a bf16 grid, for a float32 model too
    assert ((dequantized.view_as(groups) - groups).abs() <= 0.5 * steps + rounding).all()


# rows: one, a partial tile of the kernel's 6, whole tiles and a remainder; 136 input channels would
# not make whole blocks, so 128 and 192; 40 and 70 output channels leave padding in the last tile
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 200])
@pytest.mark.parametrize("shape", [(128, 40), (192, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_multiplies_blockwise_int8_activations_by_int8_weights(rows, shape, dtype):
    """Each row is quantized per block of 64 input channels (largest magnitude -> 127, rounded half
    to even), times the int8 weights, scaled back: the reference computes exactly that in float64."""
    torch.manual_seed(rows)
    linear = nn.Linear(*shape, bias=True).to(dtype)
    q = quant.W8A8Linear(linear)
    x = torch.randn(rows, shape[0]).to(dtype)
    x[:, 5] *= 20  # an outlier channel: only its own block's scale follows it
    x[0, 64:128] = 0  # an all-zero block
    blocks = x.float().view(rows, -1, quant.W8A8_BLOCK)
    top = blocks.abs().amax(-1, keepdim=True)
    ints = (blocks * torch.where(top > 0, 127 / top, torch.zeros_like(top))).round().clamp(-127, 127).double()
    weight = q.int8_weight().double().view(shape[1], -1, quant.W8A8_BLOCK)
    sums = torch.einsum("rbk,obk->rob", ints, weight) * (top.double() / 127).view(rows, 1, -1)
    expected = sums.sum(-1) * q.scale[: shape[1]].double() + linear.bias.detach().double()
    got = q(x)
    assert got.dtype == dtype and got.shape == (rows, shape[1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2 * float(expected.abs().max())
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_w8a8_outliers_cost_only_their_block():
    """An outlier channel 100x the rest, in one of 8 blocks: per-block scales keep the other blocks'
    activations fine, where one scale per row rounds most of the row to zero. The rounding errors
    add up in quadrature: one block's against eight is about 1 / sqrt(8) of the error."""
    torch.manual_seed(0)
    q = quant.W8A8Linear(nn.Linear(512, 64, bias=False))
    x = torch.randn(4, 512)
    x[:, 3] *= 100
    weight = q.int8_weight().float() * q.scale[:64, None]
    step = x.abs().amax(1, keepdim=True) / 127
    per_row_error = (F.linear((x / step).round() * step, weight) - F.linear(x, weight)).abs().mean()
    assert (q(x) - F.linear(x, weight)).abs().mean() < 0.5 * per_row_error  # measured 0.37


def test_w8a8_refuses_inputs_it_cannot_block():
    with pytest.raises(InvalidRequestError, match="divisible by 64"):
        quant.W8A8Linear(nn.Linear(96, 64))


def test_int4_refuses_inputs_it_cannot_group():
    with pytest.raises(InvalidRequestError, match="divisible by 32"):
        quant.Int4Linear(nn.Linear(48, 64))


@pytest.mark.parametrize("method, kind", [("int8", quant.Int8Linear), ("int4", quant.Int4Linear)])
def test_the_engine_quantized_equals_the_engine_with_the_dequantized_weights(tiny_llama_path, method, kind):
    """(w8a8 differs from its dequantized weights by the activations' rounding: see its own test and
    the engine test below.)"""
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (7, 40)]
    quantized = LLM(model=str(tiny_llama_path), dtype="float32", quantization=method, num_blocks=64)
    assert isinstance(quantized.engine.runner.model.layers[0].mlp.down_proj, kind)
    reference = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64)
    with torch.no_grad():
        for name, module in quantized.engine.runner.model.named_modules():
            if isinstance(module, kind):
                reference.engine.runner.model.get_submodule(name).weight.copy_(_dequantized(module))
    outs = [llm.generate(prompts, greedy(8, logprobs=0)) for llm in (quantized, reference)]
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got = [lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        ref = [lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        # the packed kernels read the float32 model's activations as bf16 (quant.kernel_dtype)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=2e-2, rtol=0)


def test_the_w8a8_engine_stays_near_the_float32_engine(tiny_llama_path):
    """End to end, prefill (many rows: int8 activations) and batched decode: first-token logprobs
    within int8 activations' rounding, and the quantized layers in place."""
    prompts = [{"prompt_token_ids": random_prompt(30 + n, seed=n)} for n in range(10)]
    w8a8 = LLM(model=str(tiny_llama_path), dtype="float32", quantization="w8a8", num_blocks=64)
    assert isinstance(w8a8.engine.runner.model.layers[0].self_attn.qkv_proj, quant.W8A8Linear)
    reference = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64)
    outs = [llm.generate(prompts, greedy(1, logprobs=5)) for llm in (w8a8, reference)]
    deltas = []
    for a, b in zip(*outs):
        token, top = b.outputs[0].token_ids[0], a.outputs[0].logprobs[0]
        if token in top:
            deltas.append(abs(top[token] - b.outputs[0].logprobs[0][token]))
    assert len(deltas) >= 8 and max(deltas) < 0.02  # measured: at most 0.005


def test_a_float32_model_runs_the_packed_kernels_on_bf16_activations():
    """torch's packed kernels are vectorized for bf16 activations only (float32 ones took 4-20x the
    float32 GEMM's time): a float32 model's quantized layers hold their scales in bf16, feed the
    kernel bf16 rows and give float32 back."""
    linear = nn.Linear(64, 64)
    for kind, grid in ((quant.Int8Linear, "scale"), (quant.Int4Linear, "grid")):
        q = kind(linear)
        assert getattr(q, grid).dtype == torch.bfloat16
        assert q(torch.randn(2, 64)).dtype == torch.float32
    assert quant.kernel_dtype(torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int3"), "unknown quantization 'int3'"),
    (dict(quantization="int4", dtype="float16"), "needs bfloat16 or float32"),
    (dict(quantization="int8", dtype="float16"), "needs bfloat16 or float32"),
])
def test_quantizations_that_cannot_run_are_refused_at_start(tiny_llama_path, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(model=str(tiny_llama_path), num_blocks=64, **kwargs)


def test_int8_on_a_gpu_is_refused():
    with pytest.raises(InvalidRequestError, match="runs on the CPU"):
        quant.check("int8", torch.device("cuda"), torch.bfloat16)


def _dequantized(module) -> torch.Tensor:
    if isinstance(module, quant.Int8Linear):
        return module.int8_weight().float() * module.scale.float()[:, None]
    return module.dequantized().float()
