"""A build's check before the engine uses it: each entry point computes one small product whose
answer torch gives, in float32 and bfloat16, on shapes that reach its tails (sizes that are not
multiples of its vectors or tiles). A compiler, a flag or a CPU that makes a kernel wrong then
costs speed (the torch path), never a wrong answer. It takes milliseconds, once per process.
"""

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from spanserve.kernels.layouts import (
    BLOCK_DIRECT_ROWS,
    BLOCK_SUPER,
    DTYPES,
    block_int8_twin,
    block_panels,
    block_weight,
    f32_panels,
    factor_panels,
    int8w_panels,
    pair_panels,
    w8a8_panels,
    w8a8_twin,
)


def check(lib: ctypes.CDLL) -> str:
    """'' if every entry point of `lib` gives the known products; else what failed first."""
    for name, case in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            try:
                problem = case(lib, dtype)
            except Exception as exc:  # noqa: BLE001 - any failure means: do not use this build
                problem = f"raised {exc!r}"
            if problem:
                return f"{name} ({dtype}): {problem}"
    return ""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _compare(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    err = (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-6)
    return "" if err <= tol else f"relative error {err:.2e} over {tol:.0e}"


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


# Row counts of the float32 GEMM's checks: a few rows, and enough for the AVX2 tile's second
# blocking (f32_gemm.c, MANY_ROWS) and for block_gemm.c's widened slices (past DIRECT_MAX_ROWS), with a tail.
FEW_ROWS, MANY_ROWS = 3, 27


def _at_row_counts(case: Callable[[int], str]) -> str:
    """case(rows) at FEW_ROWS and MANY_ROWS: '' or the first problem, with its row count."""
    for rows in (FEW_ROWS, MANY_ROWS):
        problem = case(rows)
        if problem:
            return f"{rows} rows: {problem}"
    return ""


def _f32_gemm(lib, dtype) -> str:
    if dtype != torch.float32:
        return ""  # float32 activations only
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(50, 37, generator=gen), torch.randn(50, generator=gen)
    packed = f32_panels(w)

    def case(rows: int) -> str:
        x, out = torch.randn(rows, 37, generator=gen), torch.empty(rows, 50)
        status = lib.f32_gemm(_ptr(x), _ptr(packed), _ptr(bias), _ptr(out), rows, 50, packed.shape[0] * 16, 37)
        return f"status {status}" if status else _compare(out, x @ w.t() + bias, 1e-5)
    return _at_row_counts(case)


def _f32_gemm_int8w(lib, dtype) -> str:
    if dtype != torch.float32:
        return ""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (50, 150), generator=gen, dtype=torch.int8)
    scale = torch.rand(50, generator=gen) / 100
    packed, padded = int8w_panels(q, scale)

    def case(rows: int) -> str:
        x, out = torch.randn(rows, 150, generator=gen), torch.empty(rows, 50)
        status = lib.f32_gemm_int8w(_ptr(x), _ptr(packed), _ptr(padded), None, _ptr(out), rows, 50, padded.shape[0],
                                    150)
        return f"status {status}" if status else _compare(out, x @ (q.float() * scale[:, None]).t(), 1e-5)
    return _at_row_counts(case)


def _f32_gemm_bf16w(lib, dtype) -> str:
    if dtype != torch.float32:
        return ""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(50, 70, generator=gen).bfloat16()
    packed = f32_panels(w)

    def case(rows: int) -> str:
        x, out = torch.randn(rows, 70, generator=gen), torch.empty(rows, 50)
        status = lib.f32_gemm_bf16w(_ptr(x), _ptr(packed), None, _ptr(out), rows, 50, packed.shape[0] * 16, 70)
        return f"status {status}" if status else _compare(out, x @ w.float().t(), 1e-5)
    return _at_row_counts(case)


def _bf16_pairs_gemm(lib, dtype) -> str:
    if dtype != torch.bfloat16:
        return ""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 70, generator=gen).bfloat16(), torch.randn(50, 70, generator=gen).bfloat16()
    packed, out = pair_panels(w), torch.empty(9, 50)
    status = lib.bf16_pairs_gemm(_ptr(x), _ptr(packed), None, _ptr(out), 9, 50, packed.shape[0] * 16, 70)
    if status == -2:
        return ""  # no bf16 dot products in this build
    return f"status {status}" if status else _compare(out, x.float() @ w.float().t(), 1e-5)


def _int8_gemm(lib, dtype) -> str:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 128, generator=gen).to(dtype)
    q = torch.randint(-127, 128, (70, 128), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(70, generator=gen) / 100, torch.randn(70, generator=gen)
    packed, comp, padded = w8a8_panels(q, scale)
    out = torch.empty(7, 70, dtype=dtype)
    status = lib.int8_gemm(_ptr(x), _ptr(packed), _ptr(comp), _ptr(padded), _ptr(bias), _ptr(out), 7, 70,
                           padded.shape[0], 128, DTYPES[dtype])
    return f"status {status}" if status else _compare(out, w8a8_twin(x, q, scale, bias), _tol(dtype))


def _rms_norm(lib, dtype) -> str:
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 37, generator=gen).to(dtype), torch.randn(37, generator=gen).to(dtype)
    out = torch.empty_like(x)
    status = lib.rms_norm(_ptr(x), _ptr(w), _ptr(out), 3, 37, 1e-6, DTYPES[dtype])
    x32 = x.float()
    want = w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))
    return f"status {status}" if status else _compare(out, want, _tol(dtype))


def _silu_mul(lib, dtype) -> str:
    gen = torch.Generator().manual_seed(5)
    gate_up = (4 * torch.randn(3, 2 * 37, generator=gen)).to(dtype)
    out = torch.empty(3, 37, dtype=dtype)
    status = lib.silu_mul(_ptr(gate_up), _ptr(out), 3, 37, DTYPES[dtype])
    gate, up = gate_up.float().chunk(2, dim=-1)
    return f"status {status}" if status else _compare(out, F.silu(gate) * up, _tol(dtype))


def paged_cache(gen: torch.Generator, dtype: torch.dtype, lens: list[int], block_size: int = 4, kv_heads: int = 2,
                dim: int = 64, spare_blocks: int = 2, table_pad: int = 0):
    """A paged cache holding sequences of `lens` tokens in blocks scattered over a pool with
    `spare_blocks` unused ones (holes), tables padded with `table_pad` entries past the
    sequences' blocks that point nowhere, and their keys and values gathered as float64:
    (k_cache, v_cache, tables, keys [seq], values [seq])."""
    per_seq = [-(-n // block_size) for n in lens]
    pool = sum(per_seq) + spare_blocks
    k_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(pool, generator=gen).tolist()
    tables = torch.full((len(lens), max(per_seq) + table_pad), pool + 7)  # never read
    keys, values = [], []
    for s, (n, blocks) in enumerate(zip(lens, per_seq)):
        ids = [order.pop() for _ in range(blocks)]
        tables[s, :blocks] = torch.tensor(ids)
        keys.append(k_cache[ids].reshape(-1, kv_heads, dim)[:n].double())
        values.append(v_cache[ids].reshape(-1, kv_heads, dim)[:n].double())
    return k_cache, v_cache, tables, keys, values


def softmax_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [heads, dim] over keys, values [n, kv_heads, dim] (grouped query heads), in float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.softmax((k @ q.double()[:, :, None]).squeeze(-1) * scale, dim=-1)
    return (weights[:, None, :] @ v).squeeze(1)


def _paged_decode(lib, dtype) -> str:
    lens, heads, dim, scale = [7, 3], 4, 64, 0.125
    k_cache, v_cache, tables, keys, values = paged_cache(torch.Generator().manual_seed(6), dtype, lens)
    q = torch.randn(2, heads, dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    out, lens_t = torch.empty_like(q), torch.tensor(lens)
    status = lib.paged_decode(_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(tables), _ptr(lens_t), 2,
                              tables.shape[1], heads, 2, dim, 4, scale, DTYPES[dtype], DTYPES[dtype])
    want = torch.stack([softmax_attention(q[s].float(), keys[s], values[s], scale) for s in range(2)])
    return f"status {status}" if status else _compare(out, want, _tol(dtype))


def _paged_prefill(lib, dtype) -> str:
    lens, heads, dim, scale = [9], 4, 64, 0.125
    k_cache, v_cache, tables, keys, values = paged_cache(torch.Generator().manual_seed(6), dtype, lens)
    positions = torch.tensor([5, 6, 7, 8])
    q = torch.randn(4, heads, dim, generator=torch.Generator().manual_seed(8)).to(dtype)
    out, starts, lens_t = torch.empty_like(q), torch.tensor([0, 4]), torch.tensor(lens)
    status = lib.paged_prefill(_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(tables), _ptr(starts),
                               _ptr(positions), _ptr(lens_t), None, None, None, None, 0, 1, 4, tables.shape[1],
                               heads, 2, dim, 4, scale, DTYPES[dtype], DTYPES[dtype])
    want = torch.stack([softmax_attention(q[r].float(), keys[0][: p + 1], values[0][: p + 1], scale)
                        for r, p in enumerate(positions.tolist())])
    return f"status {status}" if status else _compare(out, want, _tol(dtype))


def _rope_store(lib, dtype) -> str:
    tokens, heads, kv_heads, dim, slots = 3, 4, 2, 16, 10
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(tokens, n, dim, generator=gen).to(dtype) for n in (heads, kv_heads, kv_heads))
    angles = torch.arange(8)[:, None].float() * (0.5 ** torch.arange(dim // 2).float())
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    positions, slot_ids = torch.tensor([0, 3, 7]), torch.tensor([4, 0, 9])
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    cache = torch.zeros(2, slots, kv_heads, dim, dtype=dtype)
    status = lib.rope_store(_ptr(q), _ptr(k), _ptr(v), heads * dim, kv_heads * dim, kv_heads * dim, _ptr(positions),
                            _ptr(cos), _ptr(sin), 8, _ptr(q_out), _ptr(k_out), _ptr(cache[0]), _ptr(cache[1]),
                            _ptr(slot_ids), slots, tokens, heads, kv_heads, dim, DTYPES[dtype], DTYPES[dtype])
    if status:
        return f"status {status}"

    def rotated(x):
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    return (_compare(q_out, rotated(q), _tol(dtype)) or _compare(k_out, rotated(k), _tol(dtype))
            or _compare(cache[0][slot_ids], rotated(k), _tol(dtype)) or _compare(cache[1][slot_ids], v, 0.0))


def _centroid_topk(lib, dtype) -> str:
    """Of blocks 10..15, the first (a sink), the last (recent) and the one whose centroid points
    along the queries (13), in order, then the sequence's own block."""
    heads, kv_heads, dim = 4, 2, 16
    gen = torch.Generator().manual_seed(10)
    centroids = (0.01 * torch.randn(20, kv_heads * dim, generator=gen)).to(dtype)
    q = torch.randn(2, heads, dim, generator=gen).to(dtype)
    folded = q.float().view(2, kv_heads, heads // kv_heads, dim).sum((0, 2)).flatten()
    centroids[13] = (folded / folded.norm()).to(dtype)
    block_ids, own, table = torch.arange(10, 16), torch.tensor([20]), torch.full((7,), -1)
    count = lib.centroid_topk(_ptr(centroids), DTYPES[dtype], _ptr(block_ids), 6, _ptr(own), 1, _ptr(q),
                              DTYPES[dtype], 2, heads, kv_heads, dim, heads * dim, 1, 1, 3, _ptr(table))
    got = table[:count].tolist()
    return "" if got == [10, 13, 15, 20] else f"picked {got}, not [10, 13, 15, 20]"


def _block_gemm(lib, dtype) -> str:
    """4- and 5-bit codes with offsets and a bias, 8-bit codes with neither, per 32 or 16 inputs
    (GGUF's Q4_1, Q5_1, Q8_0 and Q6_K), Q4_K's and Q6_K's factored int8 scales, and Q6_K's codes
    in 6 bits (int8 x's layout)."""
    if dtype != torch.float32:
        return ""  # float32 activations only
    gen = torch.Generator().manual_seed(11)
    for bits, group, factored in ((4, 32, False), (5, 32, False), (8, 32, False), (8, 16, False), (4, 32, True),
                                  (8, 16, True), (6, 16, True)):
        k = BLOCK_SUPER if factored else 64
        low, high = (0, 1 << bits) if bits < 8 else (-128, 128)
        codes = torch.randint(low, high, (50, k), generator=gen)
        with_offset = bits in (4, 5)
        if factored:
            scale = torch.randint(-64, 64, (50, k // group), generator=gen).to(torch.int8)
            offset = torch.randint(0, 64, (50, k // group), generator=gen).to(torch.int8) if with_offset else None
            factors = torch.rand(50, 1, 2, generator=gen) / 64
        else:
            scale, factors = torch.rand(50, k // group, generator=gen), None
            offset = torch.randn(50, k // group, generator=gen) if with_offset else None
        bias = torch.randn(50, generator=gen) if with_offset else None
        blocks = (codes, scale, offset, factors)
        problem = _at_row_counts(functools.partial(_block_case, lib, gen, bits, group, blocks, bias))
        if problem:
            return f"{bits}-bit codes in groups of {group}{', factored' if factored else ''}, {problem}"
    return ""


def _block_case(lib, gen, bits, group, blocks, bias, rows: int) -> str:
    codes, scale, offset, factors = blocks
    k = codes.shape[1]
    packed, scales, offsets = block_panels(codes, bits, scale, offset)
    if bits == 6:  # the codes stand for code - 32
        blocks = (codes - 32, scale, offset, factors)
    factor_args = None if factors is None else factor_panels(factors)
    x, out = torch.randn(rows, k, generator=gen), torch.empty(rows, 50)
    call = functools.partial(lib.block_gemm, _ptr(x), _ptr(packed), bits, group, _ptr(scales), _ptr(offsets),
                             _ptr(factor_args), _ptr(bias), _ptr(out), rows, 50, scales.shape[0] * 16, k)
    status = call(0)
    want = x @ block_weight(*blocks).t() + (0 if bias is None else bias)
    problem = f"status {status}" if status else _compare(out, want, 1e-5)
    if bits in (4, 6) and not problem:  # and with x rounded to int8, up to the direct path's rows
        status = call(1)
        if rows <= BLOCK_DIRECT_ROWS:
            want = block_int8_twin(x, *blocks).float() + (0 if bias is None else bias)
        problem = f"int8 x: status {status}" if status else _compare(out, want, 1e-5)
    return problem


CASES: dict[str, Callable[[ctypes.CDLL, torch.dtype], str]] = {
    "f32_gemm": _f32_gemm, "f32_gemm_int8w": _f32_gemm_int8w, "f32_gemm_bf16w": _f32_gemm_bf16w,
    "bf16_pairs_gemm": _bf16_pairs_gemm, "int8_gemm": _int8_gemm, "rms_norm": _rms_norm,
    "silu_mul": _silu_mul, "paged_decode": _paged_decode, "paged_prefill": _paged_prefill,
    "rope_store": _rope_store, "centroid_topk": _centroid_topk, "block_gemm": _block_gemm,
}
