"""Weight-only int8 (quantization="int8"): the kernel paths compute the dequantized weights'
product, the engine with int8 equals an engine holding those dequantized weights, and what
cannot run is refused at start."""

import pytest
import torch
from helpers import greedy, random_prompt
from torch import nn

from spanserve import LLM, InvalidRequestError
from spanserve.models import quant


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])  # the packed kernel up to 8 rows, the GEMM beyond
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_computes_the_dequantized_product(rows, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)
    q = quant.Int8Linear(linear)
    x = torch.randn(2, rows, 96).to(dtype)
    dequantized = q.qweight.float() * q.scale.float()[:, None]
    expected = x.float() @ dequantized.t() + linear.bias.float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(q(x).float(), expected, atol=tol, rtol=tol)
    weight = linear.weight.float()  # each row within a step of its grid (127 steps to its largest entry)
    assert ((dequantized - weight).abs().amax(1) <= 0.01 * weight.abs().amax(1)).all()


def test_the_engine_with_int8_equals_the_engine_with_the_dequantized_weights(tiny_llama_path):
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (7, 40)]
    int8 = LLM(model=str(tiny_llama_path), dtype="float32", quantization="int8", num_blocks=64)
    assert isinstance(int8.engine.runner.model.layers[0].mlp.down_proj, quant.Int8Linear)
    reference = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64)
    with torch.no_grad():
        for name, module in int8.engine.runner.model.named_modules():
            if isinstance(module, quant.Int8Linear):
                target = reference.engine.runner.model.get_submodule(name)
                target.weight.copy_(module.qweight.float() * module.scale.float()[:, None])
    outs = [llm.generate(prompts, greedy(8, logprobs=0)) for llm in (int8, reference)]
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got = [lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        ref = [lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int4"), "unknown quantization 'int4'"),
    (dict(quantization="int8", dtype="float16"), "needs bfloat16 or float32"),
])
def test_quantizations_that_cannot_run_are_refused_at_start(tiny_llama_path, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(model=str(tiny_llama_path), num_blocks=64, **kwargs)


def test_int8_on_a_gpu_is_refused():
    with pytest.raises(InvalidRequestError, match="runs on the CPU"):
        quant.check("int8", torch.device("cuda"), torch.bfloat16)
