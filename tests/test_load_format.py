"""load_format="dummy": the model's shape with random weights and no checkpoint read, for
benchmarks of models that are not on the machine (as vLLM's flag)."""

import pytest
import torch
from helpers import greedy
from safetensors.torch import load_file

from spanserve import LLM, InvalidRequestError


def test_dummy_weights_have_the_shape_not_the_values_of_the_checkpoint(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", load_format="dummy", num_blocks=64)
    model = llm.engine.runner.model
    stored = load_file(str(next(tiny_llama_path.glob("*.safetensors"))))["lm_head.weight"]
    stored = stored.to(model.lm_head.weight.device)
    assert model.lm_head.weight.shape == stored.shape
    assert not torch.allclose(model.lm_head.weight, stored)
    assert 0.015 < model.layers[0].mlp.down_proj.weight.std() < 0.025
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_load_format_and_backend_are_clear_errors(tiny_llama_path):
    with pytest.raises(InvalidRequestError, match="load_format"):
        LLM(model=str(tiny_llama_path), load_format="pt")
    with pytest.raises(InvalidRequestError, match="attention backend"):
        LLM(model=str(tiny_llama_path), attention_backend="flash")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequestError, match="needs a CUDA device"):
            LLM(model=str(tiny_llama_path), attention_backend="triton", num_blocks=64)
