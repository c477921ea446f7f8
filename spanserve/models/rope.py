"""Rotary position embedding, applied at an explicit position per token.

Positions come from the batch (one per token), never from `arange`: position-independent
spans place tokens at positions that differ from their slot in the sequence.
"""

import math

import torch

from spanserve.errors import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, ramp, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin table; `forward` rotates q and k at the given positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables, e.g. after the model was built on the meta device."""
        head_dim, max_positions, theta, scaling = self.args
        device = self.cos.device if self.cos.device.type != "meta" else torch.device("cpu")
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv_freq)
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, tables=None):
        """q and k rotated to `positions`; `tables` (from `tables`) saves building them again in
        every layer of a step: a decode step is made of small ops, whose count is its cost on a CPU."""
        cos, sin = tables if tables is not None else self.tables(positions, q.dtype)
        return _rotate_full(q, cos, sin), _rotate_full(k, cos, sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` over the whole head, [T, 1, head_dim], sin negated on the first
        half. In the activations' dtype, as transformers does: a float32 round trip of q and k cost
        1.7 ms per layer for 512 bf16 tokens here (a tenth of a prefill)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` with whole-head tables (RotaryEmbedding.tables): the same products, fewer ops."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) by the angle of each position (HF's rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
