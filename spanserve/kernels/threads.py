"""CPU intra-op threads only where they pay.

Shared machines need threads that sleep when idle (spinning OpenMP threads starve other
processes), and waking a sleeping thread for a parallel op costs about 50 us here, more than a
small matmul, block gather or elementwise op takes on one thread. The package asks for threads
that spin briefly and then sleep (OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT, set before torch
loads OpenMP; spanserve/__init__.py): the ops of one step come back to back, so the second
thread is still awake for the next one, and every op of a step takes the whole pool. Where
threads sleep at once (the user chose OMP_WAIT_POLICY=PASSIVE with no spin count), a step that
is not large runs on one thread and takes the whole pool only for the calls with enough work:
matmuls over many tokens, attention over many keys.
"""

import os
import threading
from contextlib import contextmanager

import torch

# libgomp spins unless told PASSIVE with no spin count of its own.
THREADS_SPIN = not (os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
                    and os.environ.get("GOMP_SPINCOUNT", "0") in ("", "0"))
# Where threads sleep at once, a call takes the pool from (step tokens, matmul work, attention
# work): from 512 tokens a step's elementwise ops are big enough to pay for waking the pool.
# Work is multiply-adds. A matmul is rows x weight size: the layers' matmuls need 10-50 rows,
# the LM head (49k x 576 here) pays from one row on, as two cores read its weights faster.
# Attention is query rows x heads x keys (8 decodes over 700 keys: 0.66 ms on 2 threads, 0.86
# ms on 1). spanserve's C GEMMs pay from less work than torch's matmuls (use_pool_for_matmuls):
# SmolLM2's w8a8 decode step on an AMD EPYC (AVX2) took 51 ms with every projection on the
# pool against 45-49 on one thread at batch 1 (one row: 0.3-1.8M multiply-adds), 125-153 against
# 146-150 at batch 8 (2.7-14M), and a session question's 26 rows 112 against 188 ms. From 2^21
# (one-off script, decode after 1,024 tokens, taking turns, ms per token): batch 1 40.6-43.7
# against 41.9-43.7 with none on the pool, batch 8 118.7-126.2 against 139.3-141.2 (float32
# 127.7-139.7 against 156.4-174.9).
SLEEPING_THRESHOLDS = (512, 1 << 24, 1 << 14, 1 << 21)
STEP_MIN_TOKENS, MATMUL_MIN_WORK, ATTENTION_MIN_WORK, C_GEMM_MIN_WORK = \
    (1, 0, 0, 0) if THREADS_SPIN else SLEEPING_THRESHOLDS

_state = threading.local()  # per stepping thread: OpenMP thread counts are per thread too


@contextmanager
def step_threads(num_tokens: int):
    """Run one model step: the whole pool for a large step, one thread for a small one."""
    pool = torch.get_num_threads()
    _state.pool = pool  # set while a step runs
    torch.set_num_threads(pool if num_tokens >= STEP_MIN_TOKENS else 1)
    try:
        yield
    finally:
        torch.set_num_threads(pool)
        _state.pool = None


def attention_threads(work: int):
    """Inside a step: the whole pool for an attention call with `work` >= ATTENTION_MIN_WORK,
    one thread otherwise. Outside a step, leaves the threads as they are."""
    return _threads_for(work >= ATTENTION_MIN_WORK)


def small_ops():
    """Inside a step: one thread for a run of small torch ops (a sparse flow picking blocks), none
    of which pays for waking the pool (a block pick over 30 layers: 16 ms on one thread, 22-56 ms
    on two). Outside a step, leaves the threads as they are."""
    return _threads_for(False)


def use_pool_for_matmuls(model: torch.nn.Module) -> None:
    """Hooks on every projection of `model`: inside a step, one with MATMUL_MIN_WORK or more takes
    the whole pool, and so does one with C_GEMM_MIN_WORK or more whose call runs spanserve's C GEMM
    (its `sizes_team(rows)` is true), which starts only the threads its work pays for
    (WORK_PER_THREAD in kernels/csrc/). None where every call takes the pool (threads that spin): a hook
    costs more than nothing."""
    if MATMUL_MIN_WORK == 0:
        return
    def before(module, args):
        rows = args[0].numel() // module.in_features
        work = rows * module.in_features * module.out_features
        in_c = work >= C_GEMM_MIN_WORK and getattr(module, "sizes_team", None) is not None and module.sizes_team(rows)
        module._spanserve_threads = _threads_for(work >= MATMUL_MIN_WORK or in_c)
        module._spanserve_threads.__enter__()

    def after(module, args, output):
        module._spanserve_threads.__exit__(None, None, None)

    before.thread_policy = after.thread_policy = True  # is_thread_policy

    for module in model.modules():  # a quantized projection that may run the C GEMM has sizes_team
        if isinstance(module, torch.nn.Linear) or hasattr(module, "sizes_team"):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)


def is_thread_policy(hook) -> bool:
    """Whether a module's forward hook is use_pool_for_matmuls', which only sizes the threads."""
    return getattr(hook, "thread_policy", False)


def whole_step_threads():
    """Inside a step: the whole pool for one call that runs a step's layers (models/fused_layers.py),
    whose work pays for waking it. Outside a step, leaves the threads as they are."""
    return _threads_for(True)


def one_torch_thread() -> None:
    """From now on, torch on the calling thread runs on that thread alone (a server's helper
    thread: see helper_thread)."""
    torch.set_num_threads(1)


@contextmanager
def helper_thread():
    """Torch work on a thread other than the one that steps the model (a server's helper) runs on
    that thread alone: a parallel op there would start a second OpenMP thread team, and with more
    team threads than cores libgomp shortens every worker's spin, the engine's included
    (engine/async_engine.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _threads_for(large: bool):
    """Inside a step: the whole pool if `large`, else one thread; the count before comes back
    after (so these nest). Outside a step: nothing changes."""
    pool = getattr(_state, "pool", None)
    if pool is None:
        yield
        return
    before, want = torch.get_num_threads(), (pool if large else 1)
    if want != before:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if want != before:
            torch.set_num_threads(before)
