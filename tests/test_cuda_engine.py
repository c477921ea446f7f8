"""The CUDA path end to end (tiny random model, float32): the Triton kernel and decode graphs
give the greedy tokens and logprobs of the CPU torch reference, with spans reused in a new
order (rotated keys in the kernel and in the graphs), batches that pad a graph bucket, and APE,
which falls back to the torch path. Skipped without CUDA."""

import json

import pytest
import torch
from helpers import greedy, random_prompt

from spanserve import LLM

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DOCS = [random_prompt(48 + 16 * i, seed=70 + i) for i in range(3)]  # spans of token prompts start on blocks
PROMPTS = [random_prompt(n, seed=80 + n) for n in (5, 37, 150)]


def make_llm(path, device, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", device=device, num_blocks=256, **kwargs)


def spanned(order: list[int], question: int) -> dict:
    ids, spans = random_prompt(16, seed=90), []
    for i in order:
        spans.append([len(ids), len(ids) + len(DOCS[i])])
        ids = ids + DOCS[i]
    return {"prompt_token_ids": ids + random_prompt(9, seed=question), "spans": spans}


def run(llm: LLM, prompts, link_policy="none"):
    outs = llm.generate(prompts, greedy(12, logprobs=0, link_policy=link_policy))
    return ([o.outputs[0].token_ids for o in outs],
            [torch.tensor([lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs])


def assert_same(got, expected):
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


@pytest.mark.parametrize("eager", [False, True])
def test_plain_batches_equal_the_cpu_reference(tiny_llama_path, eager):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]  # three sequences: a padded bucket of 4
    gpu = make_llm(tiny_llama_path, "cuda", enforce_eager=eager)
    assert_same(run(gpu, prompts), run(make_llm(tiny_llama_path, "cpu"), prompts))
    graphs = gpu.engine.runner.graphs
    assert (graphs is None) == eager
    if not eager:
        assert (4, 1, False) in graphs.graphs


@pytest.mark.parametrize("link_policy", ["none", "ape"])
def test_warm_spans_in_a_new_order_equal_the_cpu_reference(tiny_llama_path, link_policy):
    cold, warm = [spanned([0, 1, 2], 1)], [spanned([2, 0, 1], 2), spanned([1, 2], 3)]
    results = []
    for device in ("cuda", "cpu"):
        llm = make_llm(tiny_llama_path, device)
        results.append([run(llm, cold, link_policy), run(llm, warm, link_policy)])
    for got, expected in zip(*results):
        assert_same(got, expected)


def test_decode_graphs_replay_rotated_span_keys(tiny_llama_path):
    """With the moved span keys left shared, decode graphs rotate them; with private rotated
    copies (the default), decode is a plain graph."""
    rotating = make_llm(tiny_llama_path, "cuda", span_key_copies=False)
    copying = make_llm(tiny_llama_path, "cuda")
    for llm in (rotating, copying):
        run(llm, [spanned([0, 1], 4)])
    warm = [spanned([1, 0], 5)]  # moved: decode reads keys at new positions
    assert_same(run(rotating, warm), run(copying, warm))
    assert (1, 1, True) in rotating.engine.runner.graphs.graphs
    assert (1, 1, True) not in copying.engine.runner.graphs.graphs


def test_constrained_decoding_on_cuda_equals_the_cpu_reference(tiny_llama_path):
    """The grammar's mask (built on the CPU) applied to CUDA logits: the same greedy JSON and tool
    calls as on the CPU, in a batch with a free request (CUDA graphs on)."""
    from spanserve import SamplingParams, Tools

    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 999}}}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema}), greedy(12)]
    # one call: the tiny model would repeat calls past max_tokens, and a cut call is text
    tools = Tools([{"type": "function", "function": {"name": "f", "parameters": schema}}], "required", parallel=False)
    chat = [{"role": "user", "content": "Call f."}]
    results = []
    for device in ("cuda", "cpu"):
        llm = make_llm(tiny_llama_path, device)
        texts = [o.outputs[0].text for o in llm.generate(prompts, params)]
        call = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60), tools=tools)[0].outputs[0]
        results.append((texts, tools.reply(call.text, call.finish_reason).tool_calls[0].arguments))
    assert results[0] == results[1]
    assert isinstance(json.loads(results[0][0][0])["n"], int)
