"""A bf16 projection's few-row product in spanserve's C GEMM (csrc/f32_gemm.c), on the CPU's path:
bf16 dot products over weights packed in pairs along the input (bf16_pairs_gemm) where the
build has AVX-512 BF16 and the input size is even, else the weights widened to float32 as they are
loaded (f32_gemm_bf16w). models/layout.py's PackedLinear and the calibration share it.
"""

from dataclasses import dataclass

import torch

from spanserve.kernels.layouts import F32_TILE, f32_panels, pair_panels


@dataclass
class Bf16Panels:
    packed: torch.Tensor  # the weight in the chosen path's layout
    pairs: bool  # bf16_pairs_gemm's layout, else f32_gemm_bf16w's
    out_features: int
    in_features: int


def has_pairs(kernel) -> bool:
    """Whether this build dots bf16 pairs (an empty product answers 0, not -2)."""
    probe = getattr(kernel, "bf16_pairs_gemm", None)
    return probe is not None and probe(None, None, None, None, 0, 1, F32_TILE, 2) == 0


def pack(weight: torch.Tensor, kernel) -> Bf16Panels:
    """weight [out, in] bf16 in the layout of the kernel's best path."""
    out_features, in_features = weight.shape
    if has_pairs(kernel) and in_features % 2 == 0:
        return Bf16Panels(pair_panels(weight), True, out_features, in_features)
    return Bf16Panels(f32_panels(weight), False, out_features, in_features)


def matmul(kernel, x: torch.Tensor, panels: Bf16Panels, bias32: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] bf16 times the weight (+ bias), in float32 [rows, out]."""
    rows = x.shape[0]
    out = torch.empty(rows, panels.out_features, dtype=torch.float32)
    bias = None if bias32 is None else bias32.data_ptr()
    padded = panels.packed.shape[0] * 16
    if panels.pairs:
        x = x.contiguous()
        status = kernel.bf16_pairs_gemm(x.data_ptr(), panels.packed.data_ptr(), bias, out.data_ptr(), rows,
                                        panels.out_features, padded, panels.in_features)
    else:
        x = x.float().contiguous()
        status = kernel.f32_gemm_bf16w(x.data_ptr(), panels.packed.data_ptr(), bias, out.data_ptr(), rows,
                                       panels.out_features, padded, panels.in_features)
    if status != 0:  # -1: shapes (checked by the caller)
        raise RuntimeError(f"bf16 GEMM failed ({status}) for {tuple(x.shape)} x {panels.out_features}")
    return out
