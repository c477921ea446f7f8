"""Quantized projections on CPU: weight-only int8 and int4, and w8a8 (int8 weights and int8
activations), the fastest of the three at every batch size on a CPU with VNNI.

A decode step of a small model reads every weight once for a few rows of activations: its cost is
the weight bytes. int8 weights with one scale per output channel halve them; int4 weights with a
scale and an offset per group of 32 input channels (llama.cpp's Q4_1 grid) take them to about 0.6
bytes per weight. torch's packed CPU kernels multiply either without a dequantized copy. For many
rows (a prefill chunk) those kernels lose to the bf16 GEMM, so such calls dequantize the weight on
the fly and use the GEMM. Activations, the KV cache, norms and the embedding stay in the model's
dtype; a float32 model's activations enter the packed kernels as bf16 (kernel_dtype).

w8a8 keeps int8's weights and quantizes the activations too, in spanserve's own C kernel
(kernels/csrc/int8_gemm.c), one scale per row and block of 64 input channels, so the product is int8 by
int8 (VNNI on x86). Per-block scales keep an outlier channel from flattening its whole row, what
per-token scales (torch._int_mm) lost. SmolLM2's 121 projections with cold weights on
a 2-core Xeon without bf16 (`spanserve bench projections`): 12.1 against 30.2 ms
(float32) for one row, 29.0 against 82.2 for 26, 465 against 736 for 512. On an AMD EPYC with
AVX2 only (its own integer path): 13.6 against 43.9 ms for one row, 43.6 against 53.7
for 8, 297 against 285 for 64. `spanserve bench quant` reports the drift beside the speed.
"""

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from spanserve.errors import InvalidRequestError
from spanserve.kernels import cpu_kernel, native
from spanserve.kernels.layouts import W8A8_BLOCK, f32_unpacked, int8w_panels, w8a8_panels, w8a8_twin, w8a8_unpacked
from spanserve.models import layout

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4", "w8a8")
# The packed int8 kernel against dequantizing every weight for the bf16 GEMM, SmolLM2's 30 layers
# (threads spinning): 12 against 70 ms at 16 rows, 87 against 102 at 128, 127 against 110 at 192.
# The C GEMM (f32_gemm_int8w) runs up to layout.PACKED_MAX_ROWS rows: 256 rows 1065 against 1381
# ms dequantized, 512 rows even (AMD EPYC).
TORCH_PACKED_MAX_ROWS = 128
# The int4 kernel's time grows with every row; beyond this many, dequantizing for the GEMM wins
# (SmolLM2's 30 layers: 39.7 against 60.9 ms at 64 rows, 78.1 against 69.6 at 128).
INT4_PACKED_MAX_ROWS = 64
# torch's packed int8 kernel on AVX-512 (torch 2.13, `_weight_int8pack_mm`) reads input channels
# 16 at a time with no tail: other sizes gave garbage or a segfault on an AMD Zen 4 and an Intel
# Sapphire Rapids. Its weight and activations are zero-padded to a multiple of this.
TORCH_INT8_K_MULTIPLE = 16
INT4_GROUP = 32  # input channels sharing one scale and offset
INT4_LANES = 64  # a weight's rows are padded to this, a multiple of every packed layout's block


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype in torch's packed kernels: bf16 for a float32 model. Those kernels are
    vectorized for bf16 activations only; with float32 ones, 30 SmolLM2-sized matvecs took 52 ms
    (int8) and 101 ms (int4) against 12 ms for the float32 GEMM they replace, and bf16 ones 6.7 and
    3.5 ms (a Xeon without bf16 instructions, where float32 is the `auto` dtype)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _int8_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [out, in] with one symmetric scale per output channel (its largest magnitude
    maps to 127), the scale in `scale_dtype` and the weights rounded against that stored scale."""
    weight = weight.detach().float()
    scale = (weight.abs().amax(1).clamp_min(1e-12) / 127).to(scale_dtype)
    return (weight / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """A Linear whose weight is int8, per output channel: W ~ qweight * scale[:, None].

    Up to layout.PACKED_MAX_ROWS rows run in spanserve's C GEMM (kernels/csrc/f32_gemm.c, f32_gemm_int8w) over the
    int8 weight packed in its panels of 16 output channels, the activations in float32; without
    that library, up to TORCH_PACKED_MAX_ROWS in torch's packed kernel over the row-major weight;
    more rows dequantize the weight for the float GEMM. SmolLM2's 121 projections on
    an AMD EPYC with AVX2 only (no bf16 instructions, `spanserve bench projections`):
    1 row 23.3 ms against torch's 29.9 (float32 43.9), 8 rows 51.0 against 81.4, 64 rows 341
    against 572. The C path's products are float32's, torch's those of bf16 activations."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the scale as torch's kernel reads it: both paths below multiply by the same weight
        qweight, scale = _int8_per_channel(linear.weight, kernel_dtype(linear.weight.dtype))
        self.kernel = cpu_kernel.load("gemm")
        if self.kernel is None:  # torch's kernel reads it row-major, padded (TORCH_INT8_K_MULTIPLE)
            self.k_pad = -self.in_features % TORCH_INT8_K_MULTIPLE
            self.register_buffer("qweight", F.pad(qweight, (0, self.k_pad)).contiguous())
        else:
            packed, scale32 = int8w_panels(qweight, scale)
            self.register_buffer("packed", packed)
            self.register_buffer("scale32", scale32)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight [out_features, in_features], from whichever layout holds it."""
        if self.kernel is None:
            return self.qweight[:, : self.in_features]
        return f32_unpacked(self.packed, self.out_features)

    def sizes_team(self, rows: int) -> bool:
        """Whether `rows` rows run in the C GEMM, which starts the threads its work pays for (threads.py)."""
        return self.kernel is not None and rows <= layout.PACKED_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.sizes_team(rows.shape[0]):
            return self._packed_gemm(rows).to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.kernel is None and rows.shape[0] <= TORCH_PACKED_MAX_ROWS:
            padded = F.pad(rows, (0, self.k_pad)) if self.k_pad else rows
            out = torch._weight_int8pack_mm(padded.to(self.scale.dtype), self.qweight, self.scale).to(x.dtype)
        else:
            out = F.linear(rows, self.int8_weight().to(x.dtype) * self.scale.to(x.dtype)[:, None])
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _packed_gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in] times the packed int8 weight in the C GEMM, bias included, in float32."""
        x = rows.float().contiguous()
        bias = None if self.bias is None else self.bias.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        status = self.kernel.f32_gemm_int8w(x.data_ptr(), self.packed.data_ptr(), self.scale32.data_ptr(),
                                            None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                            self.out_features, self.scale32.shape[0], self.in_features)
        if status != 0:  # -1: shapes (fixed at construction)
            raise RuntimeError(f"f32_gemm_int8w failed ({status}) for {tuple(x.shape)} x {self.out_features}")
        return out


class W8A8Linear(nn.Module):
    """int8 weights, one scale per output channel, times activations quantized to int8 per row and
    block of W8A8_BLOCK input channels, in spanserve's C kernel (kernels/csrc/int8_gemm.c: AVX-512
    VNNI where the CPU has it), over weights packed for it once (kernels/layouts.py). Where the C
    library is not there (no compiler, or it failed its self-check) the same product runs in its
    torch twin, slower; the engine says so at start (check)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        _require_divisible("w8a8", self.in_features, W8A8_BLOCK)
        qweight, scale = _int8_per_channel(linear.weight, torch.float32)
        packed, comp, padded_scale = w8a8_panels(qweight, scale)
        self.register_buffer("packed", packed)
        self.register_buffer("comp", comp)
        self.register_buffer("scale", padded_scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.kernel = cpu_kernel.load("gemm")

    def sizes_team(self, rows: int) -> bool:
        """Whether its C kernel runs, which starts the threads its work pays for (threads.py)."""
        return self.kernel is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.kernel is None:
            out = w8a8_twin(rows, self.int8_weight(), self.scale, self.bias).to(x.dtype)
            return out.view(*x.shape[:-1], self.out_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        status = self.kernel.int8_gemm(
            rows.data_ptr(), self.packed.data_ptr(), self.comp.data_ptr(), self.scale.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), rows.shape[0],
            self.out_features, self.scale.shape[0], self.in_features, native.DTYPES[x.dtype])
        if status != 0:  # -1 shapes (checked at construction), -3 out of memory
            raise RuntimeError(f"int8_gemm failed ({status}) for {tuple(rows.shape)} x {self.out_features}")
        return out.view(*x.shape[:-1], self.out_features)

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight [out_features, in_features], read back from the packed panels."""
        return w8a8_unpacked(self.packed, self.out_features)


class Int4Linear(nn.Module):
    """A Linear whose weight is 4-bit per group of INT4_GROUP input channels: W ~ low + q * step
    (q in 0..15, low and step per group), held in the layout of torch's packed CPU kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        _require_divisible("int4", self.in_features, INT4_GROUP)
        rows = -(-self.out_features // INT4_LANES) * INT4_LANES
        weight = F.pad(linear.weight.detach().float(), (0, 0, 0, rows - self.out_features))
        groups = weight.view(rows, -1, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        dtype = kernel_dtype(linear.weight.dtype)
        step = ((high - low) / 15).clamp_min(1e-8).to(dtype).float()  # the grid as the kernel will see it
        offset = (low + 8 * step).to(dtype).float()  # the kernel computes (q - 8) * step + offset
        q = ((groups - offset[..., None]) / step[..., None] + 8).round().clamp(0, 15).to(torch.int32)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.view(rows, -1), 1))
        # [groups, rows, 2]: step and offset, the kernel's layout
        self.register_buffer("grid", torch.stack([step, offset], -1).transpose(0, 1).contiguous().to(dtype))
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out_features, in_features] in the kernel's dtype."""
        return self._transposed_weight()[:, : self.out_features].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= INT4_PACKED_MAX_ROWS:
            out = torch._weight_int4pack_mm_for_cpu(rows.to(self.grid.dtype), self.packed, INT4_GROUP,
                                                    self.grid).to(x.dtype)
        else:
            out = rows @ self._transposed_weight().to(x.dtype)
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _transposed_weight(self) -> torch.Tensor:
        """The dequantized weight [in_features, padded rows], read from the kernel's packed layout:
        per block of `lanes` output rows, for each input column `lanes / 2` bytes, whose low nibble
        is row `j` of the block and high nibble row `lanes / 2 + j`. In that order the nibbles
        already run along the input columns, so one pass dequantizes a block."""
        rows, cols, lanes = self.packed.shape[0], self.in_features, packed_block_rows()
        blocks, groups = rows // lanes, cols // INT4_GROUP
        x = self.packed.view(blocks, cols, 1, lanes // 2)
        q = torch.cat([x & 15, x >> 4], -2).view(blocks, groups, INT4_GROUP, lanes)
        step, offset = self.grid.float().unbind(-1)  # [groups, rows]

        def per_block(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(groups, blocks, 1, lanes).transpose(0, 1).contiguous().to(self.grid.dtype)

        weight = torch.addcmul(per_block(offset - 8 * step), q.to(self.grid.dtype), per_block(step))
        return weight.view(blocks, cols, lanes).transpose(0, 1).reshape(cols, rows)


@functools.cache
def packed_block_rows() -> int:
    """How many output rows one block of torch's packed int4 layout interleaves: it follows the
    CPU's vector width (64 with AVX-512, 32 with AVX2), so it is read off a probe, not assumed.
    The probe packs q = (row // 8) % 8: byte 0's high nibble is then the block's middle row / 8."""
    q = (torch.arange(INT4_LANES) // 8 % 8)[:, None].expand(INT4_LANES, INT4_GROUP).to(torch.int32).contiguous()
    middle_row = 8 * int(torch._convert_weight_to_int4pack_for_cpu(q, 1).flatten()[0] >> 4)
    if middle_row not in (8, 16, 32):
        raise RuntimeError(f"unrecognized packed int4 layout in this torch build (middle row {middle_row})")
    return 2 * middle_row


def _require_divisible(method: str, in_features: int, multiple: int) -> None:
    """A method whose kernel takes input channels in groups of `multiple` refuses other sizes."""
    if in_features % multiple:
        raise InvalidRequestError(f"quantization {method!r} needs input sizes divisible by {multiple}; "
                                  f"this model has a projection of {in_features}")


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
    if method in ("w8a8", "int8") and cpu_kernel.load("gemm") is None:
        log.warning("quantization %r: spanserve's C GEMM is not used here (%s); its projections run in "
                    "torch (slower)%s", method, cpu_kernel.unavailable_reason(),
                    ", in the w8a8 kernel's torch twin" if method == "w8a8" else "")


def quantize(model: nn.Module, method: str = "int8") -> None:
    """Replace the decoder's projections and the LM head by quantized ones, in place."""
    kind = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}[method]
    for layer in model.layers:
        layer.self_attn.qkv_proj = kind(layer.self_attn.qkv_proj)
        layer.self_attn.o_proj = kind(layer.self_attn.o_proj)
        layer.mlp.gate_up_proj = kind(layer.mlp.gate_up_proj)
        layer.mlp.down_proj = kind(layer.mlp.down_proj)
    model.lm_head = kind(model.lm_head)  # a tied embedding keeps its own rows for lookups
