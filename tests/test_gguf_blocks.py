"""A GGUF's quantized projections (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) computed from the
file's own blocks (models/gguf_blocks.py): the blocks read give back the file's weights exactly,
and the engine built on them answers as the one built on their float copies."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from spanserve import LLM, EngineConfig, InvalidRequestError, SamplingParams
from spanserve.cli import build_parser, engine_config
from spanserve.kernels import cpu_kernel
from spanserve.kernels.layouts import block_bits, block_weight
from spanserve.models import gguf_blocks

needs_kernels = pytest.mark.skipif(cpu_kernel.load("gemm") is None, reason="no C kernels on this machine")


def _gguf_tensor(kind, weight: np.ndarray):
    from gguf import quants

    return SimpleNamespace(tensor_type=kind, data=quants.quantize(weight, kind))


@pytest.mark.parametrize("kind_name", ["Q4_1", "Q8_0"])
def test_blocks_read_from_a_tensor_give_back_its_dequantized_weight_exactly(kind_name):
    from gguf import GGMLQuantizationType, quants

    kind = getattr(GGMLQuantizationType, kind_name)
    weight = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    tensor = _gguf_tensor(kind, weight)
    parts = {name: torch.from_numpy(a) for name, a in gguf_blocks.blocks_of(tensor).items()}
    assert ("offset" in parts) == (kind_name == "Q4_1")
    want = torch.from_numpy(quants.dequantize(tensor.data, kind).reshape(40, 96))
    assert torch.equal(block_weight(parts["codes"], parts["scale"], parts.get("offset"), parts.get("factors")), want)


# each type's bytes per block, weights per block, and where its float16 scales (and minimums) sit
_LAYOUTS = {"Q4_0": (18, 32, [0]), "Q5_0": (22, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q5_1": (24, 32, [0, 2]),
            "Q8_0": (34, 32, [0]), "Q4_K": (144, 256, [0, 2]), "Q6_K": (210, 256, [208])}


@pytest.mark.parametrize("kind_name", list(_LAYOUTS))
def test_blocks_of_any_bytes_give_back_what_gguf_dequantizes(kind_name):
    """Random blocks (every bit pattern of the codes, fifth or top bits and 6- or 8-bit scales) with
    finite float16 scales: bit for bit what gguf's own dequantization gives."""
    from gguf import GGMLQuantizationType, quants

    kind, rng = getattr(GGMLQuantizationType, kind_name), np.random.default_rng(3)
    block_bytes, weights, float16_at = _LAYOUTS[kind_name]
    raw = rng.integers(0, 256, (12, 3, block_bytes), dtype=np.uint8)
    for at in float16_at:
        raw[..., at:at + 2] = rng.standard_normal((12, 3, 1)).astype(np.float16).view(np.uint8)
    tensor = SimpleNamespace(tensor_type=kind, data=raw.reshape(12, -1))
    parts = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in gguf_blocks.blocks_of(tensor).items()}
    assert ("offset" in parts) == (kind_name not in ("Q8_0", "Q6_K"))  # q - 8, q - 16: offsets of -8 d, -16 d
    assert block_bits(parts["codes"]) == {"Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q6_K": 8}.get(kind_name, 4)
    want = torch.from_numpy(quants.dequantize(tensor.data, kind).reshape(12, 3 * weights))
    assert torch.equal(block_weight(parts["codes"], parts["scale"], parts.get("offset"), parts.get("factors")), want)


def test_other_types_are_not_kept():
    from gguf import GGMLQuantizationType

    q5_k = np.zeros((8, 176), dtype=np.uint8)  # one super-block of 256 weights a row
    assert gguf_blocks.blocks_of(SimpleNamespace(tensor_type=GGMLQuantizationType.Q5_K, data=q5_k)) is None
    weight = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    assert gguf_blocks.blocks_of(SimpleNamespace(tensor_type=GGMLQuantizationType.F32, data=weight)) is None


def test_blocks_that_do_not_give_back_their_weight_are_not_saved(tmp_path, caplog):
    from gguf import GGMLQuantizationType

    weight = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    blocks = {"w": gguf_blocks.blocks_of(_gguf_tensor(GGMLQuantizationType.Q8_0, weight))}
    assert gguf_blocks.save_blocks(blocks, {"w": weight}, tmp_path) == 0  # the unquantized weight: no match
    assert not (tmp_path / gguf_blocks.BLOCKS_FILE).exists()
    assert "do not give back its weights" in caplog.text


def test_the_default_models_conversion_keeps_its_blocks_beside_its_exact_weights(default_model_path):
    blocks = load_file(str(default_model_path / gguf_blocks.BLOCKS_FILE))
    weights = load_file(str(default_model_path / "model.safetensors"))
    names = {key.rpartition(".")[0] for key in blocks}
    assert len(names) == 30 * 7 + 1  # every projection of SmolLM2's 30 layers (Q4_1) and its embedding (Q8_0)
    for name in names:  # the q/k rows, unpermuted like the weights, included
        got = block_weight(*(blocks.get(f"{name}.{part}") for part in ("codes", "scale", "offset", "factors")))
        assert torch.equal(got, weights[name]), name


@needs_kernels
def test_the_engine_on_blocks_answers_as_on_the_float_weights(smollm2_llm, default_model_path):
    engine = smollm2_llm.engine
    assert engine.gguf_block_projections == 121  # 30 layers x (qkv, o, gate_up, down) and the LM head
    head = engine.runner.model.lm_head
    assert isinstance(head, gguf_blocks.BlockLinear) and head.kinds == ((8, 32),)
    float_llm = LLM(model=str(default_model_path), dtype="float32", num_blocks=64, gguf_blocks=False)
    assert float_llm.engine.gguf_block_projections == 0
    prompts = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are",
               "Water boils at a temperature of"]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    ours, theirs = smollm2_llm.generate(prompts, params), float_llm.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        first_a, first_b = (next(iter(o.outputs[0].logprobs[0].values())) for o in (a, b))
        assert abs(first_a - first_b) < 1e-3  # the same weights: only the order of float32 sums differs


@needs_kernels
def test_block_projections_match_their_float_copies_at_every_path(smollm2_llm):
    """One row (direct codes), 24 (the direct path's last), 100 (widened slices), 600 (MKL on the float copy)."""
    layer = smollm2_llm.engine.runner.model.layers[3].mlp
    for module in (layer.gate_up_proj, layer.down_proj):
        assert isinstance(module, gguf_blocks.BlockLinear) and module.kinds == ((4, 32),)
        for rows in (1, 24, 100, 600):
            x = torch.randn(rows, module.in_features)
            want = x.double() @ module.weight.double().t()
            got = module(x)
            assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


@needs_kernels
def test_a_projection_of_several_kinds_of_blocks_matches_its_float_copy(tiny_qwen2_blocks_path):
    """A fused projection whose parts come in different code widths and groups (and a bias): each
    run of alike parts computed in its own call, into its own columns, at every path."""
    llm = LLM(model=str(tiny_qwen2_blocks_path), dtype="float32", num_blocks=16)
    attn = llm.engine.runner.model.layers[1].self_attn
    module = attn.qkv_proj
    assert module.kinds == ((4, 32), (8, 16)) and module.bias is not None
    assert [(p.first, p.n) for p in module.pieces] == [(0, 64 + 32), (96, 32)]  # q and k, then v
    for rows in (1, 5, 24, 100):
        x = torch.randn(rows, module.in_features)
        want = x.double() @ module.weight.double().t() + module.bias.double()
        got = module(x)
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_model_without_blocks_keeps_its_projections(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=16)
    assert llm.engine.gguf_block_projections == 0
    assert not any(isinstance(m, gguf_blocks.BlockLinear) for m in llm.engine.runner.model.modules())


def test_the_cli_turns_blocks_off_and_rounds_their_activations():
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve"])).gguf_blocks is True
    assert engine_config(parser.parse_args(["serve", "--no-gguf-blocks"])).gguf_blocks is False
    assert engine_config(parser.parse_args(["serve"])).gguf_block_activations == "float32"
    rounded = engine_config(parser.parse_args(["serve", "--gguf-block-activations", "int8"]))
    assert rounded.gguf_block_activations == "int8"


@pytest.mark.parametrize("options,error", [
    ({"gguf_block_activations": "int4"}, "unknown gguf_block_activations 'int4'"),
    ({"gguf_block_activations": "int8", "gguf_blocks": False}, "needs a GGUF's own blocks"),
    ({"gguf_block_activations": "int8", "quantization": "int8"}, "needs a GGUF's own blocks"),
])
def test_int8_activations_without_blocks_to_round_for_are_refused(options, error):
    with pytest.raises(InvalidRequestError, match=error):
        EngineConfig(**options)


@needs_kernels
def test_int8_activations_round_decode_rows_over_4_bit_blocks(default_model_path):
    """gguf_block_activations='int8': up to 24 rows, a projection over 4-bit codes multiplies x
    rounded to int8 per 32 inputs (its torch twin's sums); more rows take x as it is."""
    from spanserve.kernels.layouts import block_int8_twin

    llm = LLM(model=str(default_model_path), dtype="float32", num_blocks=16, gguf_block_activations="int8")
    module = llm.engine.runner.model.layers[0].mlp.down_proj
    assert module.int8_activations and module.kinds == ((4, 32),)
    stored = load_file(str(default_model_path / gguf_blocks.BLOCKS_FILE))
    name = "model.layers.0.mlp.down_proj.weight"
    codes, scale, offset = (stored[f"{name}.{part}"] for part in ("codes", "scale", "offset"))
    x = torch.randn(30, module.in_features)
    with torch.no_grad():
        few, many = module(x[:24]), module(x)
    twin = block_int8_twin(x[:24], codes, scale, offset)
    assert (few.double() - twin).abs().max() <= 1e-5 * twin.abs().max()
    want = x.double() @ module.weight.double().t()
    assert (many[24:].double() - want[24:]).abs().max() <= 1e-5 * want.abs().max()
    assert not torch.equal(few, many[:24]) and (few.double() - want[:24]).abs().max() <= 2e-2 * want.abs().max()


@needs_kernels
def test_a_bf16_models_few_rows_take_the_blocks_and_give_bf16(default_model_path):
    llm = LLM(model=str(default_model_path), dtype="bfloat16", num_blocks=16)
    module = llm.engine.runner.model.layers[0].self_attn.o_proj
    assert isinstance(module, gguf_blocks.BlockLinear) and module.max_rows == gguf_blocks.BF16_MAX_ROWS
    x = torch.randn(3, module.in_features).to(torch.bfloat16)
    got = module(x)
    assert got.dtype == torch.bfloat16
    want = x.double() @ module.weight.double().t()
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()
    assert module.sizes_team(24) and not module.sizes_team(25)
