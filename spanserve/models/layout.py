"""Float32 projection weights stored input-major on CPU, for small-row GEMMs.

F.linear computes x @ W.T. With W [out, in] row-major (as checkpoints store it), MKL's float32
GEMM splits few rows badly over threads: on a 2-core Xeon, SmolLM2's gate/up projection took
1.62 ms for 16 rows on 2 threads and 0.86 ms on one. The same W laid out input-major (the
[in, out] matrix contiguous, W its transposed view) goes to MKL as a plain product: 0.37 ms on 2
threads, and 0.15 against 0.88 ms for the down projection. Those are the row counts of batched
decode, a session question and a span query's question. From one row and from 64 the two layouts
cost the same. Qwen2.5's wider projections (896 in) hardly care: 0.8-1.2x per projection, 1.1-1.2x
in the engine (`spanserve bench linear_layout`). The weight keeps its shape, so
nothing that reads it changes. bf16 and CUDA GEMMs take other paths and keep the checkpoint's
layout.

Input-major, MKL still read the weights at 6-10 GB/s for 8 rows, and a float32 decode step of 8
sequences spent 85 of its 95 ms in matmuls (SmolLM2, Xeon). So the few-row products run in
spanserve's own GEMM (csrc/f32_gemm.c) over a second copy of each weight, packed in panels of 16
output channels, streamed once in order for all the rows: 0.64x MKL's time at 8 rows, 0.77x at
34. One row stays with MKL's matrix-vector product, which streams as fast; past 64 rows, where the
product is compute-bound, MKL's GEMM is faster (1.1-1.5x ours at 512-2048 rows) and keeps them.
The price is memory: one more float32 copy of the projections (0.54 GB for SmolLM2), up to
PACKED_MAX_BYTES.

A bf16 model on CPU keeps the checkpoint's layout for torch's F.linear (oneDNN, AMX tiles where
the CPU has them) and gets a packed bf16 copy too: its few-row products run in the same GEMM
reading half the bytes (kernels/bf16_gemm.py: bf16 dot products where the CPU has them), up to
the row count kernels/calibration.py measured to be faster than oneDNN on this CPU.
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from spanserve.kernels import bf16_gemm, calibration, cpu_kernel
from spanserve.kernels.layouts import f32_panels
from spanserve.models.layer_ops import records_grad

log = logging.getLogger(__name__)


def wants_input_major(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.float32 and device.type == "cpu"


def wants_packing(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and device.type == "cpu"


@torch.no_grad()
def store_weights(model: nn.Module, input_major: bool = True) -> None:
    """Relay every Linear's weight in place: input-major, or back to the checkpoint's row-major
    (`input_major=False`, for comparisons). Shapes and values stay. A tied LM head shares its
    storage with the embedding, whose lookups then gather strided rows (0.1 ms for 16 tokens here)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.data
            module.weight.data = weight.t().contiguous().t() if input_major else weight.contiguous()


# The rows the packed kernel runs for; otherwise MKL on the input-major weight: its matrix-vector
# product for one row, its GEMM for a prefill chunk past 512 rows. SmolLM2's 121 projections, cold
# (`spanserve bench projections --methods mkl`), on a Xeon: 1 row 32.0 against MKL's 28.7 ms, 8
# rows 34.8 against 54.7, 64 rows 109 against 130. On an AMD EPYC (AVX2, the kernel slicing K):
# 26 rows 130 against 264, 128 rows 550 against 633, 256 rows 1089 against 1205,
# 512 rows 2161 against 2201, 1024 rows 4291 against 4483 (even, within noise).
PACKED_MIN_ROWS, PACKED_MAX_ROWS = 2, 512
# The most memory the packed copies may add (SmolLM2 0.54 GB, Qwen2.5-0.5B 2.0 GB); a larger
# float32 model keeps MKL alone rather than double its projections (Qwen2.5-1.5B: 6.1 GB more).
PACKED_MAX_BYTES = 2_200_000_000


class PackedLinear(nn.Linear):
    """A float32 or bf16 Linear whose few-row products (decode, a question) run in spanserve's C
    GEMM (csrc/f32_gemm.c) over a copy of the weight packed in panels of 16 output channels: each
    weight is streamed once, in order, for all the rows. Larger products, autograd and a library
    that could not be built take F.linear on `weight`, which stays (shared with a tied embedding):
    the packed copy is extra memory, one copy of the projections in their dtype. `bf16_rows`: the
    most rows a bf16 weight's products run in the C GEMM (kernels/calibration.py)."""

    def __init__(self, linear: nn.Linear, bf16_rows: int = 0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.bf16 = linear.weight.dtype == torch.bfloat16
        self.rows = (1, bf16_rows) if self.bf16 else (PACKED_MIN_ROWS, None)  # None: PACKED_MAX_ROWS
        self._pack()

    @torch.no_grad()
    def _pack(self) -> None:
        weight, kernel = self.weight.detach().contiguous(), cpu_kernel.load()  # the build's paths, allowed or not
        self.panels = bf16_gemm.pack(weight, kernel) if self.bf16 and kernel is not None else None
        self.register_buffer("packed", self.panels.packed if self.panels else f32_panels(weight), persistent=False)
        bias = None if self.bias is None else self.bias.detach().float()  # the kernel adds float32
        self.register_buffer("bias32", bias, persistent=False)
        self._packed_version = self.weight._version  # a weight edited in place is packed again

    def _gemm_for(self, rows: int):
        """The C GEMM where `rows` rows run in it, else None."""
        low, high = self.rows
        high = PACKED_MAX_ROWS if high is None else min(high, PACKED_MAX_ROWS)
        return cpu_kernel.load("gemm") if low <= rows <= high else None

    def sizes_team(self, rows: int) -> bool:
        """Whether `rows` rows run in the C GEMM, which starts the threads its work pays for (threads.py)."""
        return self._gemm_for(rows) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        kernel = self._gemm_for(rows) if x.dtype == self.weight.dtype else None
        if kernel is None or records_grad(x, self.weight) or (self.bf16 and self.panels is None):
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._packed_version:
            self._pack()
        x2 = x.reshape(rows, self.in_features)
        if self.bf16:
            return bf16_gemm.matmul(kernel, x2, self.panels, self.bias32).to(x.dtype).view(*x.shape[:-1], -1)
        x2 = x2.contiguous()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = kernel.f32_gemm(x2.data_ptr(), self.packed.data_ptr(), None if self.bias32 is None else
                                 self.bias32.data_ptr(), out.data_ptr(), rows, self.out_features,
                                 self.packed.shape[0] * 16, self.in_features)
        if status != 0:  # -1: shapes (checked here)
            raise RuntimeError(f"f32_gemm failed ({status}) for {tuple(x2.shape)} x {self.out_features}")
        return out.view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def pack_projections(model: nn.Module) -> int | None:
    """Give the decoder's projections and the LM head their packed copies: a float32 or bf16 model
    on CPU whose C library is built and allowed (SPANSERVE_CPU_KERNELS names `gemm`) and whose
    copies fit PACKED_MAX_BYTES; a bf16 model's only where the calibration finds the C GEMM faster
    for some rows. Quantized projections stay as they are. Returns the most rows a bf16
    projection runs in the C GEMM (0: none), None for a model that is not bf16."""
    dtype = model.embed_tokens.weight.dtype
    bf16 = dtype == torch.bfloat16
    if cpu_kernel.load("gemm") is None:
        return 0 if bf16 else None
    layers = [(layer.self_attn, name) for layer in model.layers for name in ("qkv_proj", "o_proj")]
    layers += [(layer.mlp, name) for layer in model.layers for name in ("gate_up_proj", "down_proj")]
    targets = [(owner, name) for owner, name in [*layers, (model, "lm_head")]
               if type(getattr(owner, name)) is nn.Linear and getattr(owner, name).weight.dtype == dtype]
    extra = sum(getattr(owner, name).weight.nbytes for owner, name in targets)
    if not targets or extra > PACKED_MAX_BYTES:
        if targets:
            log.info("projections not packed for the C GEMM: the copies would take %.1f GB", extra / 1e9)
        return 0 if bf16 else None
    rows = calibration.bf16_gemm_rows(*_widest(model)) if bf16 else None
    if rows == 0:
        return 0
    for owner, name in targets:
        setattr(owner, name, PackedLinear(getattr(owner, name), rows or 0))
    log.info("projections packed for the C GEMM: %.0f MB more memory", extra / 1e6)
    return rows


def _widest(model: nn.Module) -> tuple[int, int]:
    """(in, out) of a decoder layer's largest projection: the shape the calibration times."""
    gate_up = model.layers[0].mlp.gate_up_proj
    return gate_up.in_features, gate_up.out_features
