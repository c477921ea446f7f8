"""CPU thread policy: small steps on one thread, the pool only for calls with enough work."""

import pytest
import torch
from torch import nn

from spanserve import threads


@pytest.fixture(autouse=True)
def pool_of_two():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


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
