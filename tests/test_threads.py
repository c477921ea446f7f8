"""CPU thread policy: where threads sleep at once, small steps on one thread and the pool only for
calls with enough work; where they spin briefly (the package's default), the pool for every step."""

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from spanserve.kernels import threads


@pytest.fixture(autouse=True)
def pool_of_two():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sleeping(monkeypatch):
    """The thresholds of threads that sleep at once (OMP_WAIT_POLICY=PASSIVE, no spin count)."""
    names = ("STEP_MIN_TOKENS", "MATMUL_MIN_WORK", "ATTENTION_MIN_WORK", "C_GEMM_MIN_WORK")
    for name, value in zip(names, threads.SLEEPING_THRESHOLDS):
        monkeypatch.setattr(threads, name, value)


def test_the_package_lets_threads_spin_before_they_sleep():
    """Imported before torch (as the CLI and server do), spanserve asks for threads that spin a
    bounded while, then sleep, and then gives every op of a step the whole pool."""
    script = ("import spanserve, os, torch; from spanserve.kernels import threads as t; torch.set_num_threads(2)\n"
              "with t.step_threads(1), t.attention_threads(1): n = torch.get_num_threads()\n"
              "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], t.THREADS_SPIN, n)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ACTIVE", "10000", "True", "2"]
    env["GOMP_SPINCOUNT"], env["OMP_WAIT_POLICY"] = "0", "PASSIVE"  # the user's choice stands
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "0", "False", "1"]


@pytest.mark.usefixtures("sleeping")
def test_small_step_runs_on_one_thread_and_large_work_gets_the_pool():
    with threads.step_threads(8):
        assert torch.get_num_threads() == 1
        with threads.attention_threads(threads.ATTENTION_MIN_WORK):
            assert torch.get_num_threads() == 2
            with threads.attention_threads(1):  # nested: back to the pool after
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with threads.attention_threads(threads.ATTENTION_MIN_WORK - 1):
            assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with threads.step_threads(threads.STEP_MIN_TOKENS):
        assert torch.get_num_threads() == 2
        with threads.attention_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2


def test_outside_a_step_threads_are_left_alone():
    with threads.attention_threads(0):
        assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("sleeping")
def test_matmul_hooks_pick_threads_by_rows_and_keep_results():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    seen = []
    threads.use_pool_for_matmuls(model)
    model[0].register_forward_hook(lambda m, a, o: seen.append(torch.get_num_threads()), prepend=True)
    rows = threads.MATMUL_MIN_WORK // model[0].weight.numel()
    small, large = torch.randn(rows - 1, 8), torch.randn(rows, 8)
    expected = model(large)  # outside a step: plain call
    with threads.step_threads(1):
        assert torch.equal(model(large), expected)
        model(small)
        assert torch.get_num_threads() == 1
    assert seen == [2, 2, 1]


@pytest.mark.usefixtures("sleeping")
def test_projections_in_the_c_gemm_get_the_pool_from_less_work():
    """The C GEMMs start only the threads their work pays for, so the hook gives them the pool from
    C_GEMM_MIN_WORK, under torch's MATMUL_MIN_WORK: a W8A8Linear of 8 rows runs with the pool, one
    of 1 row on one thread."""
    from spanserve.kernels import native
    from spanserve.models import quant

    try:
        native.library()
    except native.NativeUnavailable:
        pytest.skip("spanserve's C library is not built here")
    model = nn.Sequential(quant.W8A8Linear(nn.Linear(512, 512)))
    seen = []
    threads.use_pool_for_matmuls(model)
    model[0].register_forward_hook(lambda m, a, o: seen.append(torch.get_num_threads()), prepend=True)
    assert threads.C_GEMM_MIN_WORK <= 8 * 512 * 512 < threads.MATMUL_MIN_WORK
    with threads.step_threads(1):
        model(torch.randn(8, 512))
        model(torch.randn(1, 512))
    assert seen == [2, 1]


def test_helper_thread_work_runs_on_that_thread_alone():
    """A server helper's torch work must not start a second OpenMP thread team."""
    seen = []

    def helper():
        torch.set_num_threads(2)
        with threads.helper_thread():
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=helper)
    worker.start()
    worker.join()
    assert seen == [1, 2]


def test_small_ops_run_on_one_thread_inside_a_step_only():
    """A sparse flow's block picks are many small ops: one thread, not a pool woken for each."""
    with threads.step_threads(threads.STEP_MIN_TOKENS):  # a step that takes the pool, spinning or not
        assert torch.get_num_threads() == 2
        with threads.small_ops():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    with threads.small_ops():  # outside a step: as it was
        assert torch.get_num_threads() == 2
