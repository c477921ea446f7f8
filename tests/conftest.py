"""Shared fixtures: tiny random models saved as HF directories, and the real default model.

Every tiny model is built by transformers itself (random weights, fixed seed) and shares the
default model's tokenizer, so text prompts, chat templates and stop strings work on all of them.
"""

import os
from pathlib import Path

import pytest
import torch
from helpers import EOS_TOKEN_ID, VOCAB_SIZE
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from spanserve import LLM
from spanserve.models.loader import load_tokenizer, resolve_model

_TINY = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real SmolLM2-135M-Instruct as an HF dir (converted from its GGUF on first use)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer; SPANSERVE_TEST_TOKENIZER names a saved copy on machines
    without the default model (a GPU box running the CUDA tests)."""
    if os.environ.get("SPANSERVE_TEST_TOKENIZER"):
        return Path(os.environ["SPANSERVE_TEST_TOKENIZER"])
    out = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(str(out))
    return out


def _save_random_model(config, tokenizer_dir: Path, out: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms_and_biases(model)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def _randomize_norms_and_biases(model) -> None:
    """RMSNorm weights start at 1 and biases at 0: randomize them so a loader that skips or
    mixes them up changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, tokenizer_dir) -> Path:
    config = LlamaConfig(**_TINY, tie_word_embeddings=False)
    return _save_random_model(config, tokenizer_dir, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama4_path(tmp_path_factory, tokenizer_dir) -> Path:
    """Llama with four layers: room for three CacheBlend check layers (the second to the fourth).
    Weights 5x larger than the default init, so attention is peaked rather than near uniform and
    depends on where each key sits."""
    config = LlamaConfig(**{**_TINY, "num_hidden_layers": 4}, tie_word_embeddings=False, initializer_range=0.1)
    return _save_random_model(config, tokenizer_dir, tmp_path_factory.mktemp("tiny-llama4"))


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory, tokenizer_dir) -> Path:
    """Qwen3: q/k RMSNorm per head, head_dim (32) independent of hidden/heads (16), tied embeddings."""
    config = Qwen3Config(**_TINY, head_dim=32, tie_word_embeddings=True)
    return _save_random_model(config, tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, tokenizer_dir) -> Path:
    """Qwen2: biases on q/k/v (none on o), tied embeddings."""
    config = Qwen2Config(**_TINY, tie_word_embeddings=True)
    return _save_random_model(config, tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen2"))


# Each projection's blocks in tiny_qwen2_blocks: (code bits, inputs per scale); q, k and v, and
# gate and up, are fused into one projection each, so each of those holds two kinds of blocks.
_BLOCK_KINDS = {"q_proj": (4, 32), "k_proj": (4, 32), "v_proj": (8, 16), "o_proj": (8, 32), "gate_proj": (8, 32),
                "up_proj": (4, 32), "down_proj": (4, 32)}


@pytest.fixture(scope="session")
def tiny_qwen2_blocks_path(tmp_path_factory, tiny_qwen2_path) -> Path:
    """tiny_qwen2 with its projections rounded to blocks as a GGUF's (4-bit codes with a scale and an
    offset per 32 inputs, as Q4_1 and Q4_K; 8-bit codes with a scale per 32, as Q8_0, or per 16, as
    Q6_K), and the blocks stored beside the weights as a converted GGUF's (models/gguf_blocks.py)."""
    from safetensors.torch import load_file, save_file

    from spanserve.kernels.layouts import block_weight
    from spanserve.models import gguf_blocks

    out = tmp_path_factory.mktemp("tiny-qwen2-blocks")
    for f in tiny_qwen2_path.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(out / "model.safetensors"))
    blocks = {}
    for name, weight in weights.items():
        kind = _BLOCK_KINDS.get(name.split(".")[-2]) if name.endswith("proj.weight") else None
        if kind is not None:
            blocks[name] = _rounded_to_blocks(weight, *kind)
            parts = ("codes", "scale", "offset", "factors")
            weights[name] = block_weight(*(blocks[name].get(part) for part in parts))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    numpy_blocks = {name: {part: t.numpy() for part, t in parts.items()} for name, parts in blocks.items()}
    assert gguf_blocks.save_blocks(numpy_blocks, {n: w.numpy() for n, w in weights.items()}, out) == len(blocks)
    return out


def _rounded_to_blocks(weight: torch.Tensor, bits: int, group: int) -> dict[str, torch.Tensor]:
    """weight [out, in] as codes and a scale (and for 4 bits an offset, the least weight) per group."""
    grouped = weight.reshape(weight.shape[0], -1, group)
    if bits == 4:
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = (high - low) / 15
        codes = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        return {"codes": codes.reshape(weight.shape).to(torch.uint8), "scale": scale, "offset": low}
    scale = grouped.abs().amax(-1) / 127
    codes = (grouped / scale[..., None]).round().clamp(-127, 127)
    return {"codes": codes.reshape(weight.shape).to(torch.int8), "scale": scale}


# A chat template that renders tools, assistant calls and tool results (as Qwen2.5's does), for a
# tokenizer with <tool_call> and </tool_call> as tokens of their own (as Qwen2.5's has).
TOOLS_TEMPLATE = """{%- if messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}{% else %}<|im_start|>system
You are a helpful assistant.{% endif %}
{%- if tools %}

Functions you may call:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call>{% endif %}<|im_end|>
{%- for m in messages %}{% if m.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>{% elif not (loop.first and m.role == 'system') %}
<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>{% endif %}{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="session")
def tiny_tools_model_path(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny Llama whose tokenizer has tool-call tokens and whose template renders tools."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOLS_TEMPLATE
    tools_tokenizer = tmp_path_factory.mktemp("tools-tokenizer")
    tokenizer.save_pretrained(str(tools_tokenizer))
    config = LlamaConfig(**{**_TINY, "vocab_size": len(tokenizer)}, tie_word_embeddings=False)
    return _save_random_model(config, tools_tokenizer, tmp_path_factory.mktemp("tiny-tools"))


@pytest.fixture(scope="session")
def tiny_llama3_rope_path(tmp_path_factory, tokenizer_dir) -> Path:
    """Llama with Llama-3.1 RoPE scaling (the long-wavelength frequencies slowed down)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(**_TINY, tie_word_embeddings=False, rope_parameters=rope)
    return _save_random_model(config, tokenizer_dir, tmp_path_factory.mktemp("tiny-llama3-rope"))


@pytest.fixture(scope="session")
def smollm2_llm(default_model_path):
    """One float32 SmolLM2 engine shared by every module (each test leaves it idle)."""
    return LLM(model=str(default_model_path), dtype="float32", num_blocks=64)



def pytest_terminal_summary(terminalreporter):
    """Which builds of the C kernels this run executed on this CPU, and which it only compiled."""
    import sys

    variants_tests = sys.modules.get("test_kernel_variants")
    if variants_tests is not None and (variants_tests.RAN or variants_tests.COMPILED):
        flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in _cpu_flags()]
        terminalreporter.write_line(f"C kernel variants run on this CPU ({' '.join(flags) or 'no AVX2'}): "
                                    f"{', '.join(variants_tests.RAN) or 'none'}; compiled only: "
                                    f"{', '.join(variants_tests.COMPILED) or 'none'}")


def _cpu_flags() -> frozenset[str]:
    from spanserve.kernels import native

    return native.cpu_flags()
