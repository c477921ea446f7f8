"""Small helpers shared by the test modules (fixtures live in conftest.py)."""

import argparse
import os

import pytest
import torch

from spanserve import SamplingParams

VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's vocabulary, shared by every tiny model
EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from the vocabulary (special tokens 0-2 excluded)."""
    return torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def looping(length: int, seed: int) -> list[int]:
    """A prompt that repeats a phrase: a random model copies it on, and prompt lookup finds it."""
    phrase = random_prompt(7, seed=seed)
    return (phrase * (length // 7 + 1))[:length]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    """The generated token ids of every completion of every RequestOutput."""
    return [[c.token_ids for c in out.outputs] for out in outputs]


def assert_engine_idle(llm) -> None:
    """No request left anywhere and every KV block back in the free queue."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks - len(engine.kv.anchor_blocks)


def bench_args(module, argv: list[str]) -> argparse.Namespace:
    """A benchmark module's arguments as its CLI would parse them."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def triton_device() -> torch.device:
    """Where a Triton kernel test runs: CUDA, or the CPU under TRITON_INTERPRET=1 (Triton's
    interpreter, slow but exact, where Triton is installed; Triton 3.6's ran with numpy 2.2, not
    2.4, whose scalar conversions its loops trip on). Skips the calling module otherwise."""
    pytest.importorskip("triton")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not (torch.cuda.is_available() or interpret):
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
    return torch.device("cpu" if interpret else "cuda")


def record_fused_layers(model) -> list[tuple]:
    """Wrap model.fused_layers (models/fused_layers.py); returns the list it fills, per call:
    (taken?, a prefill step?, span keys moved?, the layers asked for)."""
    fused, calls = model.fused_layers, []

    def recorded(x, positions, meta, layers=None):
        out = fused(x, positions, meta, layers)
        calls.append((out is not None, min(meta.query_lens) > 1, bool(meta.key_rotation), layers))
        return out
    model.fused_layers = recorded
    return calls
