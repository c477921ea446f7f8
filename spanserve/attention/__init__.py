import torch

from spanserve.attention.backend import AttentionBackend, AttentionMetadata, KeyRotation, SpanShare
from spanserve.attention.torch_ref import TorchAttention
from spanserve.errors import InvalidRequestError
from spanserve.kernels.gpu import triton_available

BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """auto: the Triton kernel on CUDA where Triton is installed, else the torch reference."""
    if name not in BACKENDS:
        raise InvalidRequestError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    on_cuda = device is not None and device.type == "cuda"
    if name == "triton" and not (on_cuda and triton_available()):
        raise InvalidRequestError("attention backend 'triton' needs a CUDA device and the triton package")
    if name == "triton" or (name == "auto" and on_cuda and triton_available()):
        from spanserve.attention.triton_paged import TritonAttention

        return TritonAttention()
    return TorchAttention()


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "KeyRotation", "SpanShare", "TorchAttention",
           "get_backend"]
