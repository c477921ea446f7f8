from spanserve.attention.backend import AttentionBackend, AttentionMetadata, KeyRotation, SpanShare
from spanserve.attention.torch_ref import TorchAttention


def get_backend(name: str = "torch") -> AttentionBackend:
    backends = {"torch": TorchAttention}
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(backends)}")
    return backends[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "KeyRotation", "SpanShare", "TorchAttention", "get_backend"]
