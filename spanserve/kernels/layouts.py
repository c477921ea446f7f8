"""What the C kernels read: their dtype codes, the weight layouts of their GEMMs, and the w8a8
product's torch twin.

block_gemm.c reads weights kept in a GGUF file's blocks, code * scale + offset per output channel
and group of BLOCK_GROUP inputs (or 16, for 8-bit codes without an offset: Q6_K), in panels of 16
output channels padded to F32_TILE: 4-bit codes two to a byte, [padded out / 16][in][8] (channel
j's code the low nibble of byte j, channel 8 + j's the high one); 5-bit codes their low 4 bits
so, then their fifth bits as [padded out / 16][in / 32][16] uint32 (bit i of word j: input 32 g +
i of channel j); 8-bit codes [padded out / 16][in][16]; scale and offset [padded out / 16][in /
group][16] float32. A K-quant (Q4_K, Q6_K) keeps its scales as the file does, int8 per group
beside float32 factors per super-block of BLOCK_SUPER inputs (the scales' and the offsets'),
[padded out / 16][in / BLOCK_SUPER][2][16], about a third of float32 scales' bytes.

f32_gemm.c (float32, int8 and bf16 weights) reads panels of 16 output channels, [padded out /
16][in][16], padded to a tile of 48, and its bf16 dot products pairs of inputs in them, [padded out
/ 16][in / 2][16][2]; int8_gemm.c (w8a8) reads panels of 16 output channels with 4 input
channels per int32 lane, [padded out / 16][in / 4][16][4], padded to a tile of 64, beside each
block's share of the activations' +128 offset. The twin computes what int8_gemm computes, in
torch: the reference its tests and self-check hold it to, and w8a8's path where the C library
is not there.
"""

import torch
import torch.nn.functional as F

# The `dtype` codes every kernel takes for the tensors it reads and writes (common.h's load_floats).
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
F32_TILE = 48  # output channels of one tile of f32_gemm.c (TILE_PANELS x PANEL): the padding unit
W8A8_BLOCK = 64  # input channels sharing one activation scale (int8_gemm.c's QBLOCK)
W8A8_TILE = 64  # output channels its kernel computes together (TILE_PANELS x PANEL)
BLOCK_GROUP = 32  # input channels sharing a block's scale and offset (block_gemm.c), but Q6_K's 16
BLOCK_SUPER = 256  # input channels sharing a K-quant's factors (block_gemm.c's SUPER)
BLOCK_DIRECT_ROWS = 24  # up to this many rows block_gemm.c multiplies the codes directly (DIRECT_MAX_ROWS)


def f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in], float32 or int8, in f32_gemm.c's layout, output channels zero-padded to F32_TILE."""
    padded = _tile_padded(weight)
    return padded.view(-1, 16, weight.shape[1]).transpose(1, 2).contiguous()


def f32_unpacked(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [out_features, in] back from its f32_gemm.c panels."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


def pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] (in even) as bf16_pairs_gemm reads it: [padded out / 16][in / 2][16][2], output
    channels zero-padded to F32_TILE."""
    padded = _tile_padded(weight)
    return padded.view(-1, 16, weight.shape[1] // 2, 2).transpose(1, 2).contiguous()


def _tile_padded(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] with zero output channels up to a multiple of F32_TILE."""
    out_features = weight.shape[0]
    return F.pad(weight, (0, 0, 0, -(-out_features // F32_TILE) * F32_TILE - out_features))


def int8w_panels(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [out, in] and its scale per output channel as f32_gemm_int8w reads them: (the
    panels, the scale in float32 zero-padded to their output channels)."""
    packed = f32_panels(qweight)
    return packed, F.pad(scale.float(), (0, packed.shape[0] * 16 - qweight.shape[0]))


def w8a8_panels(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 weight [out, in] (in a multiple of W8A8_BLOCK) and its float32 scale per output channel
    as int8_gemm.c reads them: (packed, comp, scale padded with zeros)."""
    out_features, in_features = qweight.shape
    rows = -(-out_features // W8A8_TILE) * W8A8_TILE
    padded = F.pad(qweight, (0, 0, 0, rows - out_features))
    panels = rows // 16
    packed = padded.view(panels, 16, in_features // 4, 4).transpose(1, 2).contiguous()
    sums = padded.view(panels, 16, in_features // W8A8_BLOCK, W8A8_BLOCK).sum(-1, dtype=torch.int32)
    comp = (128 * sums).transpose(1, 2).contiguous()
    return packed, comp, F.pad(scale.float(), (0, rows - out_features)).contiguous()


def w8a8_unpacked(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The int8 weight [out_features, in] back from its w8a8 panels."""
    panels, groups = packed.shape[:2]
    return packed.transpose(1, 2).reshape(panels * 16, groups * 4)[:out_features]


def w8a8_twin(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """int8_gemm's product in torch: x [M, in] quantized per row and block of W8A8_BLOCK channels
    (the block's largest magnitude to 127, rounded half to even), the integer products of each
    block summed exactly (float32 holds 64 x 127 x 127), scaled by the block's scale and summed
    over blocks, then by the channel's scale, plus bias; float32 [M, out]."""
    rows, in_features = x.shape
    blocks = in_features // W8A8_BLOCK
    xb = x.float().reshape(rows, blocks, W8A8_BLOCK)
    top = xb.abs().amax(-1, keepdim=True)
    # (127.0 / top would be top.reciprocal() * 127 in torch: a last bit off a division, a rounding tie moved)
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    xq = (xb * inv).round().clamp(-127, 127)
    w = qweight.float().reshape(-1, blocks, W8A8_BLOCK)
    per_block = torch.bmm(xq.transpose(0, 1), w.permute(1, 2, 0))  # [blocks, M, out], exact integers
    out = (per_block * (top / 127.0).transpose(0, 1)).sum(0) * scale.float()[: qweight.shape[0]]
    return out if bias is None else out + bias.float()


def block_panels(codes: torch.Tensor, bits: int, scale: torch.Tensor,
                 offset: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes [out, in] (0..15 for 4 bits, 0..31 for 5, 0..63 for 6, int8 for 8), scale and offset
    [out, in / group] (float, or a K-quant's int8 ones) as block_gemm.c reads them: (codes, scale,
    offset) in panels, padding channels zero; 5-bit codes flat, their low bits' panels then their
    fifth bits'; 6-bit codes flat, in six_bit_panels' layout."""
    padded = _tile_padded(codes)
    panels = padded.view(-1, 16, codes.shape[1]).transpose(1, 2)
    if bits == 6:
        packed = six_bit_panels(panels)
    elif bits in (4, 5):
        nibbles = panels.to(torch.uint8) & 15
        packed = (nibbles[..., :8] | (nibbles[..., 8:] << 4)).contiguous()
        if bits == 5:  # [panels][in / 32][16] words, bit i from input 32 g + i
            fifth = (panels.to(torch.int64) >> 4 & 1).view(panels.shape[0], -1, BLOCK_GROUP, 16)
            words = (fifth << torch.arange(BLOCK_GROUP).view(1, 1, -1, 1)).sum(2).to(torch.int32)
            packed = torch.cat([packed.flatten(), words.contiguous().view(torch.uint8).flatten()])
    else:
        packed = panels.to(torch.int8).contiguous().view(torch.uint8)

    def per_panel(t: torch.Tensor) -> torch.Tensor:
        t = t if t.dtype == torch.int8 else t.float()
        return _tile_padded(t).view(-1, 16, t.shape[1]).transpose(1, 2).contiguous()

    return packed, per_panel(scale), None if offset is None else per_panel(offset)


def six_bit_panels(panels: torch.Tensor) -> torch.Tensor:
    """6-bit codes in panels [panels][in][16] as block_gemm.c's six_bit_pass reads them, flat: per
    panel and quad of inputs 32 bytes of low nibbles (byte 4c + e: channel c's for input e, and
    channel 8 + c's in the high nibble), then per panel and quad 16 bytes of top 2 bits (byte
    4 (j % 4) + e: channel j's for input e at bit 2 (j / 4))."""
    count, k = panels.shape[:2]
    quads = panels.to(torch.int32).reshape(count, k // 4, 4, 16).transpose(2, 3).contiguous()  # [.][.][channel][input]
    low, top = quads & 15, quads >> 4
    nibbles = (low[:, :, :8] | (low[:, :, 8:] << 4)).to(torch.uint8)  # [panels][quads][8][4]: byte 4c + e
    fields = top.view(count, k // 4, 4, 4, 4)  # [panels][quads][j / 4][j % 4][input]
    tops = sum(fields[:, :, s] << (2 * s) for s in range(4)).to(torch.uint8)  # [panels][quads][4][4]
    return torch.cat([nibbles.flatten(), tops.flatten()])


def factor_panels(factors: torch.Tensor) -> torch.Tensor:
    """A K-quant's factors [out, in / BLOCK_SUPER, 2] as block_gemm.c reads them: [padded out / 16][in /
    BLOCK_SUPER][2][16] float32, padding channels zero."""
    padded = _tile_padded(factors.float().flatten(1))
    return padded.view(-1, 16, factors.shape[1], 2).permute(0, 2, 3, 1).contiguous()


def block_scales(scale: torch.Tensor, offset: torch.Tensor | None, factors: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 scale and offset per group: the blocks' own, or a K-quant's int8 ones times their
    super-block's factors (factors [out, in / BLOCK_SUPER, 2]: the scales', the offsets')."""
    if factors is None:
        return scale.float(), None if offset is None else offset.float()
    per_group = factors.float().repeat_interleave(scale.shape[1] // factors.shape[1], 1)
    return scale.float() * per_group[..., 0], None if offset is None else offset.float() * per_group[..., 1]


def block_weight(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 factors: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [out, in] that blocks stand for: code * scale + offset, per group (its
    size: in over the scales' columns); with factors, a K-quant's (block_scales)."""
    group = block_group(codes, scale)
    scale, offset = block_scales(scale, offset, factors)
    weight = codes.float() * scale.repeat_interleave(group, 1)
    return weight if offset is None else weight + offset.repeat_interleave(group, 1)


def block_int8_twin(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    factors: torch.Tensor | None = None) -> torch.Tensor:
    """What block_gemm.c computes with x rounded to int8 (int8_x) over 4-bit codes in groups of 32,
    or Q6_K's codes (int8, -32..31) in groups of 16: per row and 32 inputs, q = round(x * 127 / max
    |x|) and step max |x| / 127; out = sum over groups of (codes . q) * scale * step + offset *
    sum(x), in float64 (the integer sums are exact)."""
    rows, k = x.shape
    group = block_group(codes, scale)
    scale, offset = block_scales(scale, offset, factors)
    per_step = x.float().view(rows, k // 32, 32)
    largest = per_step.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    q = torch.round(per_step * inverse).double().view(rows, k // group, group)
    step = (largest / 127.0).double().squeeze(2).repeat_interleave(32 // group, dim=1)  # [rows, groups]
    sums = torch.einsum("rgi,ngi->rng", q, codes.double().view(-1, k // group, group))  # [rows, n, groups]
    out = (sums * scale.double().unsqueeze(0) * step.unsqueeze(1)).sum(dim=2)
    if offset is not None:
        out += x.double().view(rows, k // group, group).sum(dim=2) @ offset.double().t()
    return out


def block_group(codes: torch.Tensor, scale: torch.Tensor) -> int:
    """How many input channels share each of the blocks' scales."""
    return codes.shape[1] // scale.shape[1]


def block_bits(codes: torch.Tensor) -> int:
    """How many bits block_gemm.c reads each code in: 8 for signed codes (int8, without an offset),
    else 4 or 5, the fewest that hold them."""
    if codes.dtype == torch.int8:
        return 8
    return 4 if int(codes.max()) < 16 else 5
