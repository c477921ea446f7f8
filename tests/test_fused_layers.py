"""A decode or prefill step's layers in one C call (models/fused_layers.py): taken where it applies,
and to the bit what the model's Python layers compute."""

import pytest
import torch
from helpers import record_fused_layers

from spanserve import LLM, SamplingParams
from spanserve.kernels import cpu_kernel
from spanserve.models.catalog import CATALOG
from spanserve.models.fused_layers import FusedLayers

pytestmark = pytest.mark.skipif(cpu_kernel.load("gemm") is None, reason="no C kernels on this machine")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are", "Once upon a time"]


def _counting(model):
    """Wrap model.fused_layers: how many calls it took (returned hidden states)."""
    fused, taken = model.fused_layers, []

    def counted(*args):
        out = fused(*args)
        taken.append(out is not None)
        return out
    model.fused_layers = counted
    return fused, taken


def _answers(llm, prompts, max_tokens=24):
    out = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]


def _fused_answers_as_python(llm, model):
    """Every decode step of PROMPTS through the fused layers, then through the Python layers: the
    same tokens and top-3 logprobs, exactly; the fused layers' answers."""
    fused, taken = _counting(model)
    ours = _answers(llm, PROMPTS)
    assert taken == [True] * 24  # the prompts' prefill step and every decode step of the batch
    model.fused_layers = None
    assert _answers(llm, PROMPTS) == ours  # tokens and top-3 logprobs, exactly
    model.fused_layers = fused
    return ours


QWEN = "qwen2.5-coder-0.5b-instruct"  # Q4_K, Q5_0, Q6_K and Q8_0 blocks, and q/k/v biases


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("name", ["smollm2", "qwen0.5b"])
def test_fused_layers_answer_to_the_bit_as_the_python_layers(default_model_path, kv_cache_dtype, name):
    if name == "qwen0.5b" and not CATALOG[QWEN].installed():
        pytest.skip("needs `make models`")
    model_name = str(default_model_path) if name == "smollm2" else QWEN
    llm = LLM(model=model_name, dtype="float32", num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    assert isinstance(model.fused_layers, FusedLayers)
    _fused_answers_as_python(llm, model)


def test_int8_activations_over_6_bit_codes_answer_to_the_bit_as_the_python_layers():
    """Qwen 0.5B under gguf_block_activations='int8': its Q6_K projections, kept in 6 bits then
    (block_gemm.c's six_bit_pass), answer alike in the fused layers' teams and the Python layers."""
    if not CATALOG[QWEN].installed():
        pytest.skip("needs `make models`")
    llm = LLM(model=QWEN, dtype="float32", num_blocks=64, gguf_block_activations="int8")
    model = llm.engine.runner.model
    assert any((6, 16) in layer.mlp.down_proj.kinds for layer in model.layers)
    _fused_answers_as_python(llm, model)


DOCUMENTS = ["The river Avon flows through Bath and Bristol before it meets the Severn estuary at Avonmouth.",
             "Mount Kosciuszko is the highest mountain on the Australian mainland, at 2,228 metres above the sea.",
             "The violinist practised her scales every morning before the orchestra's rehearsals began at nine."]


def test_prefill_over_moved_span_keys_answers_to_the_bit_as_the_python_layers(default_model_path):
    """Documents cached in one order, then read in another under the default policy: the focus
    probe's layers, then the relinked tokens and the question, run in the fused layers and read the
    moved span keys as the Python layers do (an engine without fused layers answers the same
    tokens and logprobs); the decode steps over moved keys take the Python layers."""
    from spanserve import Span

    answers = []
    for fused in (True, False):
        llm = LLM(model=str(default_model_path), dtype="float32", num_blocks=128)
        model = llm.engine.runner.model
        calls = record_fused_layers(model)
        if not fused:
            model.fused_layers = None
        ours = []
        for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
            prompt = [Span(DOCUMENTS[i]) for i in order] + ["Which river flows through Bath?"]
            ours += _answers(llm, [prompt], max_tokens=8)
        answers.append(ours)
        if fused:
            moved_prefill = [layers for taken, prefill, moved, layers in calls if taken and prefill and moved]
            assert any(len(layers) < len(model.layers) - 1 for layers in moved_prefill)  # a probe's run
            assert any(len(layers) == len(model.layers) - 1 for layers in moved_prefill)  # a relink
            assert not any(taken for taken, prefill, moved, _ in calls if moved and not prefill)
    assert answers[0] == answers[1]


def test_a_failing_kernel_raises_and_writes_no_slot(default_model_path):
    llm = LLM(model=str(default_model_path), dtype="float32", num_blocks=16)
    engine = llm.engine
    model = engine.runner.model
    llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))  # binds the caches
    from spanserve.attention.backend import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.tensor([10**9]), query_lens=[1], context_lens=[1],
                             block_tables=torch.zeros(1, 1, dtype=torch.long),
                             context_lens_tensor=torch.tensor([1]), positions=torch.tensor([0]))
    before = model.layers[0].self_attn.kv_cache.clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match="fused layers failed"):
        model.fused_layers(torch.zeros(1, model.cfg.hidden_size), torch.tensor([0]), meta)
    assert torch.equal(model.layers[0].self_attn.kv_cache, before)


def _captured_decode_step(llm, model):
    """Generate a few greedy tokens with model.fused_layers wrapped: the last decode step's
    (hidden states, positions, meta, KV cache before the call, output, KV cache after)."""
    fused, seen = model.fused_layers, []

    def captured(x, positions, meta, layers=None):
        before = llm.engine.runner.kv_cache.clone()
        out = fused(x, positions, meta, layers)
        if out is not None and max(meta.query_lens) == 1:
            seen.append((x.clone(), positions.clone(), meta, before, out, llm.engine.runner.kv_cache.clone()))
        return out
    model.fused_layers = captured
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0))
    model.fused_layers = fused
    return seen[-1]


def test_a_bf16_models_decode_step_is_the_float32_models_over_the_same_cache(default_model_path):
    """A bf16 model's fused decode step computes in float32 between its bf16 cache and its bf16
    hidden states: to the bit what the float32 model's fused layers (themselves the Python layers'
    sums, above) give for the same bf16 inputs, cache and norm weights, rounded once at the end."""
    ours = LLM(model=str(default_model_path), dtype="bfloat16", num_blocks=64)
    model16 = ours.engine.runner.model
    assert isinstance(model16.fused_layers, FusedLayers)
    x, positions, meta, cache, out, cache_after = _captured_decode_step(ours, model16)
    assert x.dtype == out.dtype == torch.bfloat16 and x.shape[0] == 2

    reference = LLM(model=str(default_model_path), dtype="float32", num_blocks=64, kv_cache_dtype="bfloat16")
    model32 = reference.engine.runner.model
    for layer in model32.layers:  # the bf16 model's norm weights
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.copy_(norm.weight.data.bfloat16().float())
    reference.engine.runner.kv_cache.copy_(cache)
    with torch.no_grad():
        expected = model32.fused_layers(x.float(), positions, meta)
    assert torch.equal(out, expected.bfloat16())
    assert torch.equal(cache_after, reference.engine.runner.kv_cache)  # the step's keys and values, stored alike


def test_a_bf16_model_takes_the_fused_layers_for_decode_steps_alone(default_model_path):
    """Its prefill steps keep the Python layers (bf16 rows take the calibrated bf16 paths); its
    answers stay those of the Python layers within bf16's rounding."""
    llm = LLM(model=str(default_model_path), dtype="bfloat16", num_blocks=64)
    model = llm.engine.runner.model
    calls = record_fused_layers(model)
    fused_answers = _answers(llm, PROMPTS, max_tokens=8)
    assert [taken for taken, *_ in calls] == [not prefill for _, prefill, *_ in calls] and any(t for t, *_ in calls)
    model.fused_layers = None
    python_answers = _answers(llm, PROMPTS, max_tokens=8)
    for (tokens, logprobs), (python_tokens, python_logprobs) in zip(fused_answers, python_answers):
        assert tokens[0] == python_tokens[0]  # the prefill step's token: the same layers
        # the first fused step's top logprob: bf16 rounding apart
        assert abs(max(logprobs[1].values()) - max(python_logprobs[1].values())) < 0.15


@pytest.mark.parametrize("options", [{"gguf_blocks": False}, {"quantization": "w8a8"}])
def test_no_fused_layers_where_a_projection_is_not_in_blocks(default_model_path, options):
    llm = LLM(model=str(default_model_path), num_blocks=16, **{"dtype": "float32", **options})
    assert llm.engine.runner.model.fused_layers is None


def test_no_fused_layers_for_a_model_without_blocks(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=16)
    assert llm.engine.runner.model.fused_layers is None


def test_a_hook_on_a_projection_takes_the_python_layers(smollm2_llm):
    """A COMB plug-in adds its deltas through forward hooks while it encodes: those must run."""
    model = smollm2_llm.engine.runner.model
    seen = []
    handle = model.layers[5].mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    fused, taken = _counting(model)
    try:
        smollm2_llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0))
    finally:
        model.fused_layers = fused
        handle.remove()
    assert taken and not any(taken) and len(seen) == 3  # the prompt's step and two decode steps, all in Python


def test_a_weight_edited_in_place_is_used_as_edited(default_model_path):
    """The blocks are a copy: once the float weight changes, the projection and the step use it."""
    llm = LLM(model=str(default_model_path), dtype="float32", num_blocks=16)
    model = llm.engine.runner.model
    proj = model.layers[2].mlp.down_proj
    fused, taken = _counting(model)
    with torch.no_grad():
        proj.weight.mul_(0.5)
    x = torch.randn(1, proj.in_features)
    assert proj.stale and torch.equal(proj(x), torch.nn.functional.linear(x, proj.weight))
    llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))
    assert taken and not any(taken)
    model.fused_layers = fused


def test_projections_of_several_kinds_of_blocks_take_the_fused_layers(tiny_qwen2_blocks_path):
    """q and k in 4-bit codes with v in 8-bit codes per 16 (Qwen2.5-1.5B's Q4_K beside Q6_K), gate
    and up in two kinds too: each piece its own kernel call, the same on both paths."""
    llm = LLM(model=str(tiny_qwen2_blocks_path), dtype="float32", num_blocks=64)
    model = llm.engine.runner.model
    assert llm.engine.gguf_block_projections == 2 * 4
    assert model.layers[0].self_attn.qkv_proj.kinds == ((4, 32), (8, 16))
    assert model.layers[0].mlp.gate_up_proj.kinds == ((8, 32), (4, 32))
    assert isinstance(model.fused_layers, FusedLayers)
    _fused_answers_as_python(llm, model)


@pytest.mark.parametrize("threads,batch", [(1, 4), (3, 4), (2, 30)])
def test_the_step_team_answers_as_the_python_layers(tiny_qwen2_blocks_path, threads, batch):
    """Up to 24 rows a step runs as one team of threads (fused_layers.c, team.h), one thread or
    more threads than cores; past it, each kernel on its own threads. Both to the bit."""
    llm = LLM(model=str(tiny_qwen2_blocks_path), dtype="float32", num_blocks=256)
    model = llm.engine.runner.model
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(batch)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, rows = model.fused_layers, []

        def counted(x, *args):
            out = fused(x, *args)
            rows.append(x.shape[0] if out is not None else None)
            return out
        model.fused_layers = counted
        ours = _answers(llm, prompts, max_tokens=6)
        assert None not in rows and max(rows[1:]) == batch  # every step fused, a decode step with every row
        model.fused_layers = None
        assert _answers(llm, prompts, max_tokens=6) == ours
        model.fused_layers = fused
    finally:
        torch.set_num_threads(before)


def test_int8_activations_take_the_same_kernels_on_both_paths(tiny_qwen2_blocks_path):
    """gguf_block_activations='int8': the fused layers and the Python layers both round x to int8
    over 4-bit codes (the same block_gemm calls), so they answer alike; the float activations'
    logprobs differ, a little."""
    llm = LLM(model=str(tiny_qwen2_blocks_path), dtype="float32", num_blocks=64, gguf_block_activations="int8")
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.int8_activations
    ours = _fused_answers_as_python(llm, model)
    floats = _answers(LLM(model=str(tiny_qwen2_blocks_path), dtype="float32", num_blocks=64), PROMPTS, max_tokens=1)
    first = [(tokens[:1], logprobs[:1]) for tokens, logprobs in ours]
    assert first != floats
    for (_, a), (_, b) in zip(first, floats):
        shared = [t for t in a[0] if t in b[0]]  # tokens in both top-3s
        assert shared and all(abs(a[0][t] - b[0][t]) < 0.05 for t in shared)
