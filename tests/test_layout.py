"""Float32 projection weights on CPU (spanserve/models/layout.py): stored input-major (same shapes,
same values, a tied embedding still shared and looked up right, the engine's outputs those of the
checkpoint's layout), and packed for the C GEMM of few rows (kernels/csrc/f32_gemm.c) against F.linear."""

import pytest
import torch
import torch.nn.functional as F
from helpers import greedy, random_prompt

from spanserve import LLM
from spanserve.kernels import cpu_kernel, layouts
from spanserve.models import layout

needs_gemm = pytest.mark.skipif(cpu_kernel.load("gemm") is None, reason="no C compiler: the kernel is not built")


def _linears(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]


def test_the_float32_cpu_engine_holds_every_projection_input_major(tiny_qwen2_path):
    llm = LLM(model=str(tiny_qwen2_path), dtype="float32", num_blocks=16)
    model = llm.engine.runner.model
    for linear in _linears(llm):
        assert linear.weight.t().is_contiguous() and not linear.weight.is_contiguous()
        assert linear.weight.shape == (linear.out_features, linear.in_features)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: still one tensor
    ids = torch.tensor([5, 77, 3000])
    torch.testing.assert_close(model.embed_tokens(ids), model.embed_tokens.weight.contiguous()[ids], rtol=0, atol=0)


def test_bf16_keeps_the_checkpoint_layout(tiny_llama_path):
    assert not layout.wants_input_major(torch.bfloat16, torch.device("cpu"))
    assert not layout.wants_input_major(torch.float32, torch.device("cuda"))
    llm = LLM(model=str(tiny_llama_path), dtype="bfloat16", num_blocks=16)
    assert all(linear.weight.is_contiguous() for linear in _linears(llm))


def _outputs_stay(llm, change) -> None:
    """Greedy tokens equal and logprobs within float32 rounding before and after `change()`, over a
    batch of 12 decoding together and their prompts."""
    prompts = [{"prompt_token_ids": random_prompt(20 + i, seed=i)} for i in range(12)]
    params = greedy(8, logprobs=3)
    before = llm.generate(prompts, params)
    change()
    for a, b in zip(before, llm.generate(prompts, params)):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for lp_x, lp_y, token in zip(x.logprobs, y.logprobs, x.token_ids):
            assert abs(lp_x[token] - lp_y[token]) < 1e-4


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path"])
def test_outputs_match_the_checkpoint_layout(model, request, monkeypatch):
    """MKL's GEMM at every row count (the packed one off), input-major against row-major."""
    monkeypatch.setattr(layout, "PACKED_MAX_ROWS", 0)
    llm = LLM(model=str(request.getfixturevalue(model)), dtype="float32", num_blocks=64, enable_prefix_caching=False)

    def row_major():
        layout.store_weights(llm.engine.runner.model, input_major=False)
        assert all(linear.weight.is_contiguous() for linear in _linears(llm))
    _outputs_stay(llm, row_major)


@needs_gemm
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (50, 64, True), (896, 136, True)])
def test_packed_linear_equals_f_linear(out_features, in_features, bias):
    """Every row count the kernel steps through (a whole tile of 8 rows, the remainders, several
    tiles), output channels that pad the last tile, a bias; within float32 rounding."""
    gen = torch.Generator().manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    packed = layout.PackedLinear(linear)
    assert packed.weight is linear.weight and packed.packed.shape[0] * 16 % layouts.F32_TILE == 0
    for rows in (1, 3, 7, 8, 9, 16, 29, layout.PACKED_MAX_ROWS, layout.PACKED_MAX_ROWS + 1):
        x = torch.randn(2, rows, in_features, generator=gen)[1]
        with torch.inference_mode():
            want = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
            torch.testing.assert_close(packed(x).double(), want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_packed_linear_keeps_f_linear_under_autograd_and_without_the_kernel(monkeypatch):
    linear = torch.nn.Linear(64, 40)
    packed = layout.PackedLinear(linear)
    x = torch.randn(4, 64, requires_grad=True)
    packed(x).sum().backward()  # F.linear: the gradient reaches the shared weight
    assert x.grad is not None and linear.weight.grad is not None
    monkeypatch.setattr(cpu_kernel, "_tried", True)
    monkeypatch.setattr(cpu_kernel, "_allowed", frozenset({"decode", "prefill", "layer"}))
    with torch.inference_mode():
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


@needs_gemm
def test_the_float32_cpu_engine_packs_its_projections_and_quantized_ones_stay(tiny_qwen2_path):
    model = LLM(model=str(tiny_qwen2_path), dtype="float32", num_blocks=16).engine.runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert all(isinstance(m, layout.PackedLinear) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                           mlp.down_proj, model.lm_head))
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: still one tensor
    quantized = LLM(model=str(tiny_qwen2_path), dtype="float32", num_blocks=16, quantization="w8a8")
    assert not any(isinstance(m, layout.PackedLinear) for m in quantized.engine.runner.model.modules())


@needs_gemm
def test_copies_past_the_memory_cap_are_not_made(tiny_qwen2_path, monkeypatch):
    monkeypatch.setattr(layout, "PACKED_MAX_BYTES", 1000)
    model = LLM(model=str(tiny_qwen2_path), dtype="float32", num_blocks=16).engine.runner.model
    assert not any(isinstance(m, layout.PackedLinear) for m in model.modules())


@needs_gemm
@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path"])
def test_engine_outputs_match_without_the_packed_gemm(model, request, monkeypatch):
    """The packed GEMM against the same engine with every product in F.linear."""
    llm = LLM(model=str(request.getfixturevalue(model)), dtype="float32", num_blocks=64, enable_prefix_caching=False)
    _outputs_stay(llm, lambda: monkeypatch.setattr(layout, "PACKED_MAX_ROWS", 0))


@needs_gemm
def test_a_weight_edited_in_place_is_packed_again():
    linear = torch.nn.Linear(64, 50)
    packed, x = layout.PackedLinear(linear), torch.randn(3, 64)
    with torch.inference_mode():
        before = packed(x)
    with torch.no_grad():
        linear.weight.mul_(2)
    with torch.inference_mode():
        assert not torch.allclose(packed(x), before)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))


@needs_gemm
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (50, 64, True)])
def test_packed_bf16_linear_equals_f_linear(out_features, in_features, bias):
    """A bf16 weight in the C GEMM: bf16 in and out, the float32 product of the same values
    rounded once."""
    gen = torch.Generator().manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    packed = layout.PackedLinear(linear, bf16_rows=64)
    assert packed.packed.dtype == torch.bfloat16
    for rows in (1, 2, 7, 8, 9, 64, 65):  # 65: F.linear
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        with torch.inference_mode():
            got = packed(x)
            want = F.linear(x.double(), linear.weight.double(), None if bias is False else linear.bias.double())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * in_features ** 0.5)


@needs_gemm
@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path"])
def test_the_bf16_cpu_engine_runs_few_rows_in_the_c_gemm_with_the_outputs_of_f_linear(model, request, monkeypatch):
    """Up to the calibrated rows (here forced to 4: decode of a batch of 12 takes F.linear, each
    prompt's last chunk too), against every product in F.linear."""
    monkeypatch.setattr("spanserve.kernels.calibration.bf16_gemm_rows", lambda i, o: 4)
    llm = LLM(model=str(request.getfixturevalue(model)), dtype="bfloat16", num_blocks=64, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert llm.engine.bf16_gemm_rows == 4
    assert all(isinstance(m, layout.PackedLinear) and m.rows == (1, 4)
               for m in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj, model.lm_head))
    prompts = [{"prompt_token_ids": random_prompt(20 + i, seed=i)} for i in range(3)]
    before = llm.generate(prompts, greedy(8, logprobs=3))
    monkeypatch.setattr(layout, "PACKED_MAX_ROWS", 0)
    for a, b in zip(before, llm.generate(prompts, greedy(8, logprobs=3))):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(lp_a[token] - lp_b[token]) < 0.05  # bf16 rounding of differently ordered sums


def test_a_bf16_engine_keeps_f_linear_where_the_calibration_finds_nothing_faster(tiny_llama_path, monkeypatch):
    monkeypatch.setattr("spanserve.kernels.calibration.bf16_gemm_rows", lambda i, o: 0)
    llm = LLM(model=str(tiny_llama_path), dtype="bfloat16", num_blocks=16)
    assert llm.engine.bf16_gemm_rows == 0
    assert not any(isinstance(m, layout.PackedLinear) for m in llm.engine.runner.model.modules())
