"""The per-CPU choice of a bf16 projection's path (spanserve/kernels/calibration.py): the C GEMM
keeps the row counts up to the first where F.linear is faster, a wrong product keeps every row
with torch (with a log line), and the choice is cached per CPU and shape."""

import ctypes
import logging

import pytest

from spanserve.attention import torch_ref
from spanserve.attention.backend import KeyRotation
from spanserve.kernels import calibration, cpu_kernel

needs_gemm = pytest.mark.skipif(cpu_kernel.load("gemm") is None, reason="no C compiler: the kernel is not built")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPANSERVE_CACHE_DIR", str(tmp_path))


def _timings(monkeypatch, pairs):
    """_best returns, call after call, each pair's (C GEMM, F.linear) time."""
    times = iter(t for pair in pairs for t in pair)
    monkeypatch.setattr(calibration, "_best", lambda call: next(times))


@needs_gemm
def test_the_c_gemm_keeps_the_rows_up_to_the_first_where_torch_is_faster(monkeypatch):
    _timings(monkeypatch, [(1, 2)] * 5 + [(3, 2), (1, 2)])  # faster at 1-16 rows, slower at 32, then faster again
    assert calibration.bf16_gemm_rows(64, 96) == 16


@needs_gemm
def test_the_choice_is_cached_per_shape(monkeypatch):
    _timings(monkeypatch, [(1, 2)] * 3 + [(2, 1)])
    assert calibration.bf16_gemm_rows(64, 96) == 4
    monkeypatch.setattr(calibration, "_measure", lambda *shape: pytest.fail("measured again"))
    assert calibration.bf16_gemm_rows(64, 96) == 4
    with pytest.raises(pytest.fail.Exception):
        calibration.bf16_gemm_rows(64, 48)  # another shape is measured


@needs_gemm
def test_the_real_measurement_gives_one_of_the_row_counts():
    assert calibration.bf16_gemm_rows(64, 96) in (0, *calibration.ROWS)


def test_a_wrong_product_keeps_every_row_with_torch(monkeypatch, caplog):
    class Broken:
        def f32_gemm_bf16w(self, x, packed, bias, out, rows, n, padded, k):  # every output 3.0039
            ctypes.memset(out, 0x40, rows * n * 4)
            return 0

    monkeypatch.setattr(cpu_kernel, "load", lambda name=None: Broken())
    with caplog.at_level(logging.INFO, logger="spanserve.kernels.calibration"):
        assert calibration.bf16_gemm_rows(64, 96) == 0
    assert "stay with torch" in caplog.text and "off by" in caplog.text


def test_without_the_library_every_row_stays_with_torch_and_nothing_is_cached(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "load", lambda name=None: None)
    assert calibration.bf16_gemm_rows(64, 96) == 0
    assert calibration._read() == {}  # a later start with the library measures


def _bf16_dot_kernel(setter: str = "set_bf16_dot"):
    kernel = cpu_kernel.load()
    if kernel is None or not getattr(kernel, setter)(1):
        pytest.skip("no bf16 dot-product path here (no AVX-512 BF16, or no C compiler)")
    return kernel


def test_both_bf16_decode_paths_give_the_attention_of_the_reference():
    import torch

    kernel = _bf16_dot_kernel()
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(40, 16, 2, 64, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(3, 6, 64, generator=gen).bfloat16()
    tables, lens = torch.randperm(40, generator=gen)[:30].view(3, 10), torch.tensor([160, 37, 1])
    keys = [k_cache[tables[b]].flatten(0, 1)[: lens[b]].double() for b in range(3)]
    values = [v_cache[tables[b]].flatten(0, 1)[: lens[b]].double() for b in range(3)]
    want = torch.stack([torch.einsum("hk,khd->hd", torch.softmax(torch.einsum(
        "hd,khd->hk", q[b].double(), keys[b].repeat_interleave(3, 1)) / 8, -1), values[b].repeat_interleave(3, 1))
        for b in range(3)])
    for dot in (1, 0):
        kernel.set_bf16_dot(dot)
        got = cpu_kernel.paged_decode(q, k_cache, v_cache, tables, lens, 1 / 8)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)


def test_the_decode_path_is_measured_once_and_set(monkeypatch):
    kernel = _bf16_dot_kernel()
    monkeypatch.setattr(calibration, "_dot_is_faster", lambda *args: False)
    assert calibration.use_decode_bf16_dot(6, 2, 64) is False
    monkeypatch.setattr(calibration, "_dot_is_faster", lambda *args: pytest.fail("measured again"))
    assert calibration.use_decode_bf16_dot(6, 2, 64) is False
    assert kernel.set_bf16_dot(1)  # it was set off; back on for the tests after


def test_both_bf16_prefill_paths_give_the_attention_of_the_reference():
    """A question's rows over keys, some moved by a rotation as they are read, both ways."""
    import torch

    kernel = _bf16_dot_kernel("set_prefill_bf16_dot")
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = (torch.randn(40, 16, 2, 64, generator=gen).bfloat16() for _ in range(2))
    tables, n, rows, moved = torch.randperm(40, generator=gen)[:30].view(1, 30), 470, 21, 300
    q = torch.randn(rows, 6, 64, generator=gen).bfloat16()
    angles = torch.rand(moved, 32, generator=gen) * 6
    rotation = torch_ref.key_rotations([KeyRotation.from_angles(angles.cos(), angles.sin(), 2)])
    keys = k_cache[tables[0]].flatten(0, 1)[:n].double()
    x, y = keys[:moved, :, :32].clone(), keys[:moved, :, 32:].clone()
    c, s = angles.cos().double()[:, None], angles.sin().double()[:, None]
    keys[:moved, :, :32], keys[:moved, :, 32:] = x * c - y * s, y * c + x * s
    values = v_cache[tables[0]].flatten(0, 1)[:n].double()
    positions = torch.arange(n - rows, n)
    scores = torch.einsum("thd,khd->thk", q.double(), keys.repeat_interleave(3, 1)) / 8
    scores = scores.masked_fill(torch.arange(n)[None, None] > positions[:, None, None], float("-inf"))
    want = torch.einsum("thk,khd->thd", scores.softmax(-1), values.repeat_interleave(3, 1))
    for dot in (1, 0):
        kernel.set_prefill_bf16_dot(dot)
        got = cpu_kernel.paged_prefill(q, k_cache, v_cache, tables, torch.tensor([0, rows]), positions,
                                       torch.tensor([n]), 1 / 8, rotations=rotation)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)


def test_the_prefill_path_is_measured_once_and_set(monkeypatch):
    kernel = _bf16_dot_kernel("set_prefill_bf16_dot")
    monkeypatch.setattr(calibration, "_dot_is_faster", lambda *args: False)
    assert calibration.use_prefill_bf16_dot(6, 2, 64) is False
    monkeypatch.setattr(calibration, "_dot_is_faster", lambda *args: pytest.fail("measured again"))
    assert calibration.use_prefill_bf16_dot(6, 2, 64) is False
    assert kernel.set_prefill_bf16_dot(1)  # it was set off; back on for the tests after
