"""A build of the C kernels that gives a wrong product is never used: the library's self-check
(spanserve/kernels/selfcheck.py) refuses it, the engine says why once and runs the torch paths,
and an explicit quantization still works there and says so. Also torch's own packed int8 kernel,
which reads input channels 16 at a time on AVX-512 with no tail, under every ATen CPU
capability this CPU runs."""

import functools
import logging
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import greedy, random_prompt

from spanserve import LLM
from spanserve.kernels import cpu_kernel, native, selfcheck
from spanserve.models import quant

needs_compiler = pytest.mark.skipif(native.compiler_path() is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernels as if never loaded in this process, built into an empty cache."""
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_kernel", None)
    monkeypatch.setattr(cpu_kernel, "_failure", None)
    monkeypatch.setattr(cpu_kernel, "_allowed", frozenset(cpu_kernel.KERNELS))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setenv("SPANSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _build_gemm_with(monkeypatch, tmp_path, correct: str, wrong: str) -> None:
    """Builds from now on take the sources with `correct` in f32_gemm.c replaced by `wrong`."""
    csrc = tmp_path / "csrc"
    shutil.copytree(native.CSRC, csrc)
    source = (csrc / "f32_gemm.c").read_text()
    assert correct in source
    (csrc / "f32_gemm.c").write_text(source.replace(correct, wrong))
    monkeypatch.setattr(native, "build", functools.partial(native.build, csrc))


@pytest.fixture
def wrong_build(fresh, monkeypatch, tmp_path):
    """Sources whose float32 GEMM adds one to every output: a build that compiles and runs, wrong."""
    _build_gemm_with(monkeypatch, tmp_path, "out[c] = sums[r][c] *", "out[c] = 1.0f + sums[r][c] *")


@needs_compiler
def test_the_native_build_passes_its_self_check():
    assert cpu_kernel.load() is not None and selfcheck.check(cpu_kernel.load()) == ""


@needs_compiler
def test_a_build_with_a_wrong_product_is_not_used_and_the_engine_says_why(wrong_build, caplog):
    with caplog.at_level(logging.WARNING):
        assert cpu_kernel.load() is None
    assert "self-check" in caplog.text and "f32_gemm" in caplog.text and "torch path" in caplog.text
    assert "self-check" in cpu_kernel.unavailable_reason()
    caplog.clear()
    assert cpu_kernel.load() is None and caplog.text == ""  # said once


@needs_compiler
@pytest.mark.parametrize("method", ["w8a8", "int8"])
def test_an_explicit_quantization_runs_in_torch_without_the_kernels_and_says_so(tiny_llama_path, wrong_build,
                                                                                 method, caplog):
    with caplog.at_level(logging.WARNING):
        fallback = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64, quantization=method)
    assert f"quantization {method!r}" in caplog.text and "run in torch" in caplog.text
    projection = fallback.engine.runner.model.layers[0].self_attn.qkv_proj
    assert projection.kernel is None
    prompts = [{"prompt_token_ids": random_prompt(12, seed=s)} for s in range(2)]
    got = fallback.generate(prompts, greedy(6, logprobs=1))
    cpu_kernel._tried, cpu_kernel._kernel, native._failure, native.build = False, None, None, native.build.func
    with_kernel = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64, quantization=method)
    assert with_kernel.engine.runner.model.layers[0].self_attn.qkv_proj.kernel is not None
    want = with_kernel.generate(prompts, greedy(6, logprobs=1))
    # w8a8's twin is its kernel's product; int8 in torch rounds the activations to bf16 (quant.kernel_dtype)
    for a, b in zip(got, want):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        assert a.outputs[0].token_ids[0] == token
        assert abs(first_a[token] - first_b[token]) < (1e-3 if method == "w8a8" else 5e-2)


def test_an_x86_cpu_without_avx2_takes_the_torch_paths_with_one_log_line(fresh, monkeypatch, caplog):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.WARNING):
        assert cpu_kernel.load() is None
    assert len(caplog.records) == 1 and "no AVX2" in caplog.text and "torch path" in caplog.text


def _capabilities() -> list[str]:
    """The ATen CPU capabilities this CPU executes (torch dispatches its kernels by them)."""
    flags = native.cpu_flags()
    caps = ["default"]
    if {"avx2", "fma"} <= flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        caps.append("avx512")
    return caps


@pytest.mark.parametrize("capability", _capabilities())
def test_int8_in_torch_takes_any_input_size_under_every_capability(capability):
    """torch 2.13's packed int8 kernel for AVX-512 reads input channels 16 at a time with no tail:
    200 inputs segfaulted in it (Intel Sapphire Rapids, AMD Zen 4). Int8Linear pads its weight
    and activations to a multiple of 16 for it; a child process runs the layer under the
    capability, so a crash fails this test instead of ending the run."""
    script = """
import torch
from torch import nn
from spanserve.kernels import cpu_kernel
from spanserve.models import quant
cpu_kernel._tried, cpu_kernel._kernel = True, None  # torch's kernel, not the C GEMM
torch.manual_seed(0)
for in_features in (200, 100, 37, 16):
    linear = nn.Linear(in_features, 70)
    q = quant.Int8Linear(linear)
    assert q.qweight.shape[1] % quant.TORCH_INT8_K_MULTIPLE == 0
    x = torch.randn(5, in_features)
    want = x @ (q.int8_weight().float() * q.scale.float()[:, None]).t() + linear.bias
    torch.testing.assert_close(q(x), want, atol=3e-2, rtol=3e-2)
print("ok")
"""
    env = {**__import__("os").environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_int8_pads_its_inputs_for_torchs_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_tried", True)
    monkeypatch.setattr(cpu_kernel, "_kernel", None)
    q = quant.Int8Linear(torch.nn.Linear(200, 70))
    assert q.qweight.shape == (70, 208) and q.int8_weight().shape == (70, 200)
    assert q.qweight[:, 200:].eq(0).all()


@needs_compiler
@pytest.mark.skipif("avx512f" in native.cpu_flags() or "avx2" not in native.cpu_flags(),
                    reason="the native build takes the AVX2 GEMM tile only on a CPU with AVX2 and no AVX-512")
def test_a_gemm_wrong_only_at_many_rows_is_caught(fresh, monkeypatch, tmp_path, caplog):
    """The AVX2 GEMM steps many rows with another blocking than a few (f32_gemm.c, MANY_ROWS):
    the self-check computes both, so a build wrong in the second alone is not used either."""
    correct = "for (int v = 0; v < HALF; v++) acc[r][v] = _mm256_setzero_ps();"
    _build_gemm_with(monkeypatch, tmp_path, correct, correct.replace("_mm256_setzero_ps()", "_mm256_set1_ps(1.0f)"))
    with caplog.at_level(logging.WARNING):
        assert cpu_kernel.load() is None
    assert "f32_gemm" in caplog.text and "27 rows" in caplog.text
