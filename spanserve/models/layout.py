"""Float32 projection weights stored input-major on CPU, for small-row GEMMs.

F.linear computes x @ W.T. With W [out, in] row-major (as checkpoints store it), MKL's float32
GEMM splits few rows badly over threads: on a 2-core Xeon, SmolLM2's gate/up projection took
1.62 ms for 16 rows on 2 threads and 0.86 ms on one. The same W laid out input-major (the
[in, out] matrix contiguous, W its transposed view) goes to MKL as a plain product: 0.37 ms on 2
threads, and 0.15 against 0.88 ms for the down projection. Those are the row counts of batched
decode, a session question and a span query's question. From one row and from 64 the two layouts
cost the same. Qwen2.5's wider projections (896 in) hardly care: 0.8-1.2x per projection, 1.1-1.2x
in the engine (session 28, `spanserve bench linear_layout`). The weight keeps its shape, so
nothing that reads it changes. bf16 and CUDA GEMMs take other paths and keep the checkpoint's
layout.
"""

import torch
from torch import nn


def wants_input_major(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.float32 and device.type == "cpu"


@torch.no_grad()
def store_weights(model: nn.Module, input_major: bool = True) -> None:
    """Relay every Linear's weight in place: input-major, or back to the checkpoint's row-major
    (`input_major=False`, for comparisons). Shapes and values stay. A tied LM head shares its
    storage with the embedding, whose lookups then gather strided rows (0.1 ms for 16 tokens here)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.data
            module.weight.data = weight.t().contiguous().t() if input_major else weight.contiguous()
