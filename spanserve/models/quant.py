"""Weight-only int8 quantization for CPU decode.

A decode step of a small model reads every weight once for a few rows of activations: its cost is
the weight bytes. int8 weights with one bf16 scale per output channel halve them, and torch's
packed CPU kernel multiplies them without a dequantized copy. For many rows (a prefill chunk) that
kernel loses to the bf16 GEMM, so those dequantize the weight on the fly and use the GEMM.
Activations, the KV cache, norms and the embedding stay in the model's dtype.
"""

import torch
import torch.nn.functional as F
from torch import nn

from spanserve.errors import InvalidRequestError

QUANTIZATIONS = ("int8",)
PACKED_MAX_ROWS = 8  # measured here: the packed kernel wins up to 4-8 rows, the bf16 GEMM beyond


class Int8Linear(nn.Module):
    """A Linear whose weight is int8, per output channel: W ~ qweight * scale[:, None]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(1).clamp_min(1e-12) / 127
        self.register_buffer("qweight", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= PACKED_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows, self.qweight, self.scale)
        else:
            out = F.linear(rows, self.qweight.to(x.dtype) * self.scale[:, None])
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def check(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """A method or a device/dtype that cannot run it is an error at start (before the model
    loads), never a silent fallback."""
    if method not in QUANTIZATIONS:
        raise InvalidRequestError(f"unknown quantization {method!r}; available: {', '.join(QUANTIZATIONS)}")
    if device.type != "cpu":
        raise InvalidRequestError(f"quantization {method!r} runs on the CPU (its packed kernel); the engine is on "
                                  f"{device.type}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise InvalidRequestError(f"quantization {method!r} needs bfloat16 or float32 activations, not {dtype}")


def quantize(model: nn.Module) -> None:
    """Replace the decoder's projections and the LM head by int8 ones, in place."""
    for layer in model.layers:
        layer.self_attn.qkv_proj = Int8Linear(layer.self_attn.qkv_proj)
        layer.self_attn.o_proj = Int8Linear(layer.self_attn.o_proj)
        layer.mlp.gate_up_proj = Int8Linear(layer.mlp.gate_up_proj)
        layer.mlp.down_proj = Int8Linear(layer.mlp.down_proj)
    model.lm_head = Int8Linear(model.lm_head)  # a tied embedding keeps its own rows for lookups
