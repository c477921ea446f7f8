"""Whether spanserve's Triton kernels (attention/paged_kernel.py, models/triton_layer_ops.py) can run."""

import functools

import torch


@functools.cache
def triton_available() -> bool:
    """Triton imports and a CUDA device is there."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
