"""A GGUF model's projections kept in the file's own blocks on CPU, rather than widened to float.

A llama.cpp file stores most weights quantized: SmolLM2's projections in Q4_1 (32 weights share
a float16 scale and minimum, 4 bits each), its embedding and tied LM head in Q8_0. Converted to
float32 they are 4-6x the bytes, and a decode step reads every one of them. Kept as they are and
multiplied by spanserve's C kernel (kernels/csrc/block_gemm.c), a projection computes with the
file's exact weights from their own bytes: nothing is rounded, only the order of the float32 sums
changes. The blocks are read from the file when it is converted (models/gguf.py), checked to give
back exactly the weights the conversion wrote, and stored beside them.

Kept: Q4_0, Q4_1 and Q4_K (4-bit codes, a scale and an offset per 32), Q5_0 and Q5_1 (5-bit
codes so), Q8_0 (8-bit codes and a scale per 32), Q6_K (8-bit codes and a scale per 16), whose
values are code * scale + offset in one rounding, as the kernel reads them. The K-quants' scales
stay the file's int8 ones beside their super-block's float factors (layouts.block_scales): a
decode step reads every scale too, and float32 ones would be a third of Q4_K's bytes. A fused
projection (q/k/v, gate/up) whose parts come in different widths or groups (Qwen2.5-1.5B's Q4_K q
and k beside a Q6_K v) computes each run of alike parts in its own call. Under int8 activations
Q6_K's codes are kept in 6 bits (block_gemm.c's six_bit_pass).
"""

import itertools
import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from spanserve.kernels import cpu_kernel
from spanserve.kernels.layouts import (
    BLOCK_DIRECT_ROWS,
    block_bits,
    block_group,
    block_panels,
    block_weight,
    factor_panels,
)
from spanserve.models import layout
from spanserve.models.layer_ops import records_grad

log = logging.getLogger(__name__)

BLOCKS_FILE = Path("gguf") / "blocks.safetensors"  # under the converted model's folder, out of *.safetensors' way
# bytes per 32 weights, by GGMLQuantizationType: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def blocks_of(tensor) -> dict[str, np.ndarray] | None:
    """A GGUF tensor's blocks as (codes, scale[, offset][, factors]) [rows, in], [rows, in / group]
    and [rows, in / 256, 2], or None for a type that is not kept. Each block starts with its scale
    d (float16). Q8_0: then 32 int8, 8-bit codes without an offset. Q4_1 and Q5_1: then the minimum
    m (float16), the offset; Q5_*: then the elements' fifth bits (32 in 4 bytes); then 16 bytes
    holding elements j (low nibble) and 16 + j (high). Q4_0 and Q5_0 have no minimum: their codes
    are q - 8 and q - 16, so their offset is -8 d or -16 d (exact, as is d * q: 11 by 5 bits), and
    code * d + offset is the file's value in its one rounding. Q4_K and Q6_K: _q4_k and _q6_k."""
    from gguf import GGMLQuantizationType as Kind

    kind, raw = tensor.tensor_type, np.asarray(tensor.data)
    if kind == Kind.Q4_K:
        return _q4_k(raw)
    if kind == Kind.Q6_K:
        return _q6_k(raw)
    if kind not in _BLOCK_BYTES:
        return None
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind])
    scale = _float16(blocks, 0)
    if kind == Kind.Q8_0:
        return {"codes": blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), "scale": scale}
    with_minimum = kind in (Kind.Q4_1, Kind.Q5_1)
    offset = _float16(blocks, 2) if with_minimum else scale * np.float32(-16 if kind == Kind.Q5_0 else -8)
    at = 4 if with_minimum else 2
    codes = _nibbles(blocks[..., -16:])
    if kind in (Kind.Q5_0, Kind.Q5_1):
        high = (blocks[..., at:at + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        codes |= high.astype(np.uint8) << 4
    return {"codes": codes.reshape(rows, -1), "scale": scale, "offset": offset}


def _q4_k(raw: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K's super-blocks (256 weights in 144 bytes) as 4-bit codes with a scale and an offset per
    32, as Q4_1's: each starts with d and dmin (float16), then 12 bytes of 6-bit scales and minimums
    for its 8 groups, then 128 bytes, each 32 of them holding two groups (low nibbles, then high).
    A group's weights are (d * scale) * code - dmin * minimum: both products are exact in float32
    (11 by 6 bits), so the offset -(dmin * minimum) gives them in the one rounding gguf does. Kept
    factored: the scales and minimums as int8, the factors d and -dmin."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 144)
    d, dmin = _float16(blocks, 0), _float16(blocks, 2)
    low, high, rest = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]  # scales, minimums, their top bits
    scales = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1).astype(np.int8)
    minimums = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.int8)
    codes = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32))  # [rows, super-blocks, 4, 64]: two groups each
    return {"codes": codes.reshape(rows, -1), "scale": scales.reshape(rows, -1), "offset": minimums.reshape(rows, -1),
            "factors": np.stack([d, -dmin], axis=-1)}


def _q6_k(raw: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K's super-blocks (256 weights in 210 bytes) as 8-bit codes with a scale per 16: each holds
    the codes' low 4 bits (128 bytes: per half, 64 bytes of low then high nibbles), their top 2 bits
    (64 bytes: per half, 32 bytes of four 2-bit fields), 16 int8 scales, then d (float16). A
    weight is (d * scale) * (code - 32): d * scale is exact in float32 (11 by 8 bits), so the one
    rounding gguf does. Kept factored: the scales as int8, the factor d (and 0 for the offsets)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 210)
    low = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    top = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    codes = ((low & 15).reshape(rows, -1, 256) | ((top & 3).reshape(rows, -1, 256) << 4)).astype(np.int8) - 32
    d = _float16(blocks, 208)
    return {"codes": codes.reshape(rows, -1), "scale": blocks[..., 192:208].copy().view(np.int8).reshape(rows, -1),
            "factors": np.stack([d, np.zeros_like(d)], axis=-1)}


def _float16(blocks: np.ndarray, at: int) -> np.ndarray:
    """Each block's float16 at byte `at`, as float32."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A block's 16 bytes as its 32 elements: the low nibbles, then the high ones."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def save_blocks(blocks: dict[str, dict[str, np.ndarray]], weights: dict[str, np.ndarray], out_dir: Path) -> int:
    """Write the blocks that give back their converted weight exactly; how many were kept."""
    kept = {}
    for name, arrays in blocks.items():
        parts = {part: torch.from_numpy(np.ascontiguousarray(a)) for part, a in arrays.items()}
        given_back = block_weight(parts["codes"], parts["scale"], parts.get("offset"), parts.get("factors"))
        if torch.equal(given_back, torch.from_numpy(weights[name])):
            kept.update({f"{name}.{part}": t for part, t in parts.items()})
        else:
            log.warning("%s: its GGUF blocks do not give back its weights; it loads as float", name)
    if kept:
        (out_dir / BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
        save_file(kept, str(out_dir / BLOCKS_FILE))
    return len({key.rpartition(".")[0] for key in kept})


# The most rows a bf16 model's projections take from the blocks: block_gemm.c's direct path, whose
# few rows read a fifth of bf16's bytes. More rows keep oneDNN's bf16 GEMM on the bf16 weight (AMX
# tiles where the CPU has them), which the widened blocks are not measured against.
BF16_MAX_ROWS = BLOCK_DIRECT_ROWS


class _Piece(NamedTuple):
    """Output channels first .. first + n - 1 of a projection, in one width and group of codes, as
    block_gemm takes them."""
    first: int
    n: int
    padded_out: int
    kernel_args: tuple  # codes, bits, group, scale, offset, factors, bias: pointers into `tensors`
    tensors: tuple  # packed codes, scale, offset, factors, bias: kept alive for the pointers


def _piece(parts: list[dict[str, torch.Tensor]], bits: int, group: int, bias: torch.Tensor | None,
           first: int, int8_activations: bool) -> _Piece:
    codes = torch.cat([p["codes"] for p in parts])
    scale = torch.cat([p["scale"] for p in parts])
    offset = torch.cat([p["offset"] for p in parts]) if bits < 8 else None  # 8-bit codes have none
    factors = torch.cat([p["factors"] for p in parts]) if "factors" in parts[0] else None  # a K-quant's
    if int8_activations and _six_bits(codes, group, factors):  # Q6_K's codes, for six_bit_pass
        codes, bits = codes.to(torch.int16) + 32, 6
    packed, scale, offset = block_panels(codes, bits, scale, offset)
    factors = None if factors is None else factor_panels(factors)
    n = codes.shape[0]
    bias = None if bias is None else bias.detach().float()[first:first + n].contiguous()
    args = (packed.data_ptr(), bits, group, scale.data_ptr(), *(None if t is None else t.data_ptr()
                                                                 for t in (offset, factors, bias)))
    return _Piece(first, n, scale.shape[0] * 16, args, (packed, scale, offset, factors, bias))


def _six_bits(codes: torch.Tensor, group: int, factors: torch.Tensor | None) -> bool:
    """Whether 8-bit codes are Q6_K's (-32..31 in factored groups of 16), which block_gemm.c
    multiplies with activations rounded to int8 from a layout of 6 bits a code."""
    return (codes.dtype == torch.int8 and group == 16 and factors is not None
            and int(codes.min()) >= -32 and int(codes.max()) < 32)


class BlockLinear(nn.Linear):
    """A projection computed from a GGUF's blocks (block_gemm.c) on CPU. The float `weight` stays
    for autograd, a tied embedding, a build without the C library and the rows of a prefill chunk
    past layout.PACKED_MAX_ROWS (BF16_MAX_ROWS under a bf16 model), where MKL's GEMM on it is
    faster than widening the blocks (2,048 rows of SmolLM2: 3% of the prefill). `runs` are its
    parts' blocks, (parts, bits, group) for each run of output channels alike in both."""

    def __init__(self, linear: nn.Linear, runs: list[tuple[list[dict[str, torch.Tensor]], int, int]],
                 int8_activations: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # Plain attributes, not buffers: read on every call without nn.Module's lookup (a decode step
        # makes 121 calls), and never moved or cast by Module.to (the kernel reads float32 on CPU).
        self.pieces: list[_Piece] = []
        for parts, bits, group in runs:
            first = self.pieces[-1].first + self.pieces[-1].n if self.pieces else 0
            self.pieces.append(_piece(parts, bits, group, self.bias, first, int8_activations))
        self.max_rows = BF16_MAX_ROWS if linear.weight.dtype == torch.bfloat16 else layout.PACKED_MAX_ROWS
        self.weight_version = linear.weight._version
        # Up to BLOCK_DIRECT_ROWS rows, 4-bit codes and Q6_K's (kept in 6 bits then) multiply x rounded
        # to int8 per 32 inputs (block_gemm.c)
        self.int8_activations = int8_activations

    @property
    def kinds(self) -> tuple[tuple[int, int], ...]:
        """(code bits, inputs per scale) of each piece, in output order."""
        return tuple(piece.kernel_args[1:3] for piece in self.pieces)

    @property
    def stale(self) -> bool:
        """Whether the float weight was edited in place since: the blocks then no longer hold it."""
        return self.weight._version != self.weight_version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        kernel = cpu_kernel.load("gemm") if rows <= self.max_rows else None
        if kernel is None or (torch.is_grad_enabled() and records_grad(x, self.weight)) or self.stale:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        x2 = (x2 if x.dtype == torch.float32 else x2.float()).contiguous()
        if len(self.pieces) == 1:
            out = self._run(kernel, self.pieces[0], x2)
        else:  # each piece into its own columns: block_gemm writes whole rows
            out = torch.cat([self._run(kernel, piece, x2) for piece in self.pieces], dim=1)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def _run(self, kernel, piece: _Piece, x2: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x2.shape[0], piece.n, dtype=torch.float32)
        status = kernel.block_gemm(x2.data_ptr(), *piece.kernel_args, out.data_ptr(), x2.shape[0], piece.n,
                                   piece.padded_out, self.in_features, int(self.int8_activations))
        if status != 0:  # -1 shapes (checked when kept), -3 out of memory
            raise RuntimeError(f"block_gemm failed ({status}) for {tuple(x2.shape)} x {piece.n}")
        return out

    def sizes_team(self, rows: int) -> bool:
        """Whether `rows` rows run in its C kernel, which starts the threads its work pays for (threads.py)."""
        return rows <= self.max_rows


@torch.no_grad()
def keep_blocks(model: nn.Module, model_dir: Path, int8_activations: bool = False) -> int:
    """Give the decoder's projections and the LM head whose checkpoint came in kept blocks a
    BlockLinear (`int8_activations`: BlockLinear's); how many. Nothing without the blocks file or
    the C library."""
    path = model_dir / BLOCKS_FILE
    if not path.exists() or cpu_kernel.load("gemm") is None:
        return 0
    stored = load_file(str(path))
    kept = 0
    for owner, name, sources in _projections(model):
        parts = [_parts(stored, source) for source in sources]
        linear = getattr(owner, name)
        if type(linear) is not nn.Linear or any(p is None for p in parts):
            continue
        # 4- and 5-bit codes come with an offset, 8-bit ones without; a group of 32, or 16 (Q6_K); factored or not
        kinds = [(block_bits(p["codes"]), block_group(p["codes"], p["scale"]), "factors" in p) for p in parts]
        if any(linear.in_features % group for _, group, _ in kinds):
            continue
        alike = itertools.groupby(zip(kinds, parts), key=lambda kind_part: kind_part[0])
        runs = [([p for _, p in run], *kind[:2]) for kind, run in alike]
        setattr(owner, name, BlockLinear(linear, runs, int8_activations))
        kept += 1
    if kept:
        log.info("%d projections compute from the GGUF's own blocks", kept)
    return kept


def _projections(model: nn.Module):
    """(owner, attribute, checkpoint names of its parts) for each projection and the LM head."""
    for i, layer in enumerate(model.layers):
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            kind = "self_attn" if owner is layer.self_attn else "mlp"
            parts = _FUSED.get(name, (name,))
            yield owner, name, [f"model.layers.{i}.{kind}.{part}.weight" for part in parts]
    head = "model.embed_tokens.weight" if model.lm_head.weight is model.embed_tokens.weight else "lm_head.weight"
    yield model, "lm_head", [head]


def _parts(stored: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor] | None:
    if f"{name}.codes" not in stored:
        return None
    return {part: stored[f"{name}.{part}"] for part in ("codes", "scale", "offset", "factors")
            if f"{name}.{part}" in stored}
