"""Float32 projection weights stored input-major on CPU (spanserve/models/layout.py): same shapes,
same values, a tied embedding still shared and looked up right, and the engine's outputs those
of the checkpoint's layout."""

import pytest
import torch
from helpers import greedy, random_prompt

from spanserve import LLM
from spanserve.models import layout


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


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path"])
def test_outputs_match_the_checkpoint_layout(model, request):
    """Greedy tokens equal and logprobs within float32 rounding, over a batch (the row counts where
    the layouts' GEMMs differ most) and a prompt."""
    llm = LLM(model=str(request.getfixturevalue(model)), dtype="float32", num_blocks=64, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": random_prompt(20 + i, seed=i)} for i in range(12)]
    params = greedy(8, logprobs=3)
    input_major = llm.generate(prompts, params)
    layout.store_weights(llm.engine.runner.model, input_major=False)
    assert all(linear.weight.is_contiguous() for linear in _linears(llm))
    row_major = llm.generate(prompts, params)
    for a, b in zip(input_major, row_major):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for lp_x, lp_y, token in zip(x.logprobs, y.logprobs, x.token_ids):
            assert abs(lp_x[token] - lp_y[token]) < 1e-4
