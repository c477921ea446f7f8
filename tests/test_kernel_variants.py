"""Every build variant of the C kernels (spanserve/kernels/variants.py) that this CPU can execute,
each entry point against its torch reference on random shapes (hypothesis): rows 1..600, sizes
that are not multiples of the vectors or tiles, float32 and bfloat16, strided inputs, 1 and 2
threads, block tables with holes. The variants this CPU cannot execute are compiled with their
-march. The run's summary names which variants ran and which were only compiled (conftest.py).

SPANSERVE_KERNEL_VARIANTS=sanitized runs the same tests on the native build under ASan and UBSan
alone (tests/test_kernel_sanitizers.py starts that run with the sanitizers' runtime preloaded)."""

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import record_fused_layers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanserve.attention import torch_ref
from spanserve.attention.backend import KeyRotation
from spanserve.kernels import cpu_kernel, native, selfcheck, variants
from spanserve.kernels.layouts import (
    BLOCK_DIRECT_ROWS,
    BLOCK_GROUP,
    BLOCK_SUPER,
    W8A8_BLOCK,
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

needs_compiler = pytest.mark.skipif(native.compiler_path() is None, reason="no C compiler")
SANITIZED_RUN = os.environ.get("SPANSERVE_KERNEL_VARIANTS") == "sanitized"
CHOSEN = (variants.SANITIZED,) if SANITIZED_RUN else variants.VARIANTS
EXAMPLES = int(os.environ.get("SPANSERVE_KERNEL_EXAMPLES", "12" if SANITIZED_RUN else "25"))
# derandomize: the same examples in every run (CI stays reproducible); the shapes still differ per test
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAN: list[str] = []  # variants executed in this run, and those only compiled, for the summary (conftest.py)
COMPILED: list[str] = []


@pytest.fixture(scope="module", params=CHOSEN, ids=lambda v: v.name)
def lib(request):
    """The variant's library, installed as the kernels every wrapper calls (cpu_kernel.using)."""
    variant = request.param
    if native.compiler_path() is None:
        pytest.skip("no C compiler")
    if not variant.runs_here():
        missing = " ".join(sorted(variant.needs - native.cpu_flags()))
        pytest.skip(f"{variant.name}: this CPU lacks {missing}; compiled only (test_every_variant_compiles)")
    built = variants.library(variant)
    if variant.name not in RAN:
        RAN.append(variant.name)
    with cpu_kernel.using(built):
        yield built


@needs_compiler
@pytest.mark.skipif(SANITIZED_RUN, reason="the sanitized run checks the native build only")
@pytest.mark.parametrize("variant", [*variants.VARIANTS, *variants.COMPILE_ONLY], ids=lambda v: v.name)
def test_every_variant_compiles(variant):
    if not variants.compiler_knows(variant):
        pytest.skip(f"{variant.name}: this C compiler does not know {variant.flags[0]}")
    assert variants.compile_only(variant).is_dir()
    if not variant.runs_here() or variant in variants.COMPILE_ONLY:
        COMPILED.append(variant.name)


def test_each_variant_gives_the_known_products(lib):
    assert selfcheck.check(lib) == ""


def _threads(n: int):
    """torch's thread count, which the kernels' OpenMP shares (one libgomp in the process)."""
    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)
    return Threads()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Within float32's summation error, or bf16's rounding of the result, of `want` (float64)."""
    tol = (2e-5 if dtype == torch.float32 else 1e-2) * scale
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


dtypes = st.sampled_from([torch.float32, torch.bfloat16])
threads = st.sampled_from([1, 2])
seeds = st.integers(0, 2**31 - 1)  # torch's inputs, drawn like the shapes


def _cache(data, dtype, lens: list[int], block_size: int, kv_heads: int, dim: int):
    """A paged cache with holes in its pool and padded tables (selfcheck.paged_cache), drawn."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    return selfcheck.paged_cache(gen, dtype, lens, block_size, kv_heads, dim, spare_blocks=data.draw(st.integers(0, 5)),
                                 table_pad=data.draw(st.integers(0, 2)))


_attention = selfcheck.softmax_attention


def _angles(moved: int, dim: int, run: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin of random angles for `moved` keys of head size `dim` ([moved, dim / 2]),
    alike over runs of `run` keys (the keys of one reused document move alike)."""
    angles = (torch.rand(-(-moved // run), dim // 2) * 6.28).repeat_interleave(run, 0)[:moved]
    return angles.cos(), angles.sin()


head_shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.sampled_from([8, 16, 24, 40, 64, 80, 128]))


@PROPERTY
@given(seed=seeds, data=st.data(), dtype=dtypes, n_threads=threads, heads=head_shapes,
       block_size=st.sampled_from([1, 3, 4, 16]), lens=st.lists(st.integers(1, 90), min_size=1, max_size=4))
def test_paged_decode_is_softmax_attention(lib, seed, data, dtype, n_threads, heads, block_size, lens):
    torch.manual_seed(seed)
    kv_heads, group, dim = heads
    k_cache, v_cache, tables, keys, values = _cache(data, dtype, lens, block_size, kv_heads, dim)
    q = torch.randn(len(lens), kv_heads * group, dim).to(dtype)
    scale = dim ** -0.5
    with _threads(n_threads):
        out = cpu_kernel.paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens), scale)
    want = torch.stack([_attention(q[s], keys[s], values[s], scale) for s in range(len(lens))])
    _close(out, want, dtype)


@PROPERTY
@given(seed=seeds, data=st.data(), dtype=dtypes, n_threads=threads, heads=head_shapes,
       block_size=st.sampled_from([1, 4, 16]),
       seqs=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 40)), min_size=1, max_size=3))
def test_paged_prefill_is_causal_softmax_attention(lib, seed, data, dtype, n_threads, heads, block_size, seqs):
    """Each sequence's last `rows` tokens (at most its length) query its keys up to their position;
    a sequence's first keys may be span keys moved as the kernel reads them (KeyRotation), which
    the reference rotates and, in bf16, rounds as a cache would hold them: each key its own way,
    or in runs (documents), which few rows read through queries moved the other way."""
    torch.manual_seed(seed)
    kv_heads, group, dim = heads
    lens = [n for n, _ in seqs]
    rows = [min(r, n) for n, r in seqs]
    k_cache, v_cache, tables, keys, values = _cache(data, dtype, lens, block_size, kv_heads, dim)
    moved = [data.draw(st.sampled_from([0, 1, n // 2, n])) for n in lens]
    run = data.draw(st.sampled_from([1, 7, 40, 200]))
    rotations = [KeyRotation.from_angles(*_angles(m, dim, run), kv_heads) if m else None for m in moved]
    keys = [k if r is None else r.apply(k.float()).to(dtype).to(k.dtype) for k, r in zip(keys, rotations)]
    positions = torch.cat([torch.arange(n - r, n) for n, r in zip(lens, rows)])
    starts = torch.tensor([0, *rows]).cumsum(0)
    q = torch.randn(int(starts[-1]), kv_heads * group, dim).to(dtype)
    scale = dim ** -0.5
    with _threads(n_threads):
        out = cpu_kernel.paged_prefill(q, k_cache, v_cache, tables, starts, positions, torch.tensor(lens), scale,
                                       rotations=torch_ref.key_rotations(rotations))
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(rows))
    want = torch.stack([_attention(q[t], keys[s][: p + 1], values[s][: p + 1], scale)
                        for t, (s, p) in enumerate(zip(seq_of.tolist(), positions.tolist()))])
    _close(out, want, dtype)


@PROPERTY
@given(seed=seeds, data=st.data(), dtype=dtypes, n_threads=threads, heads=head_shapes, n=st.integers(1, 700),
       rows=st.integers(1, 8), run=st.sampled_from([1, 40, 300]))
def test_paged_scores_are_the_scaled_causal_scores(lib, seed, data, dtype, n_threads, heads, n, rows, run):
    """A few rows' scores against one sequence's keys, before the softmax (the focus probe's):
    scaled, -inf after each row's position, the first keys moved each its own way or in runs."""
    torch.manual_seed(seed)
    kv_heads, group, dim = heads
    k_cache, v_cache, tables, keys, values = _cache(data, dtype, [n], 16, kv_heads, dim)
    moved = data.draw(st.sampled_from([0, n // 2, n]))
    rotation = KeyRotation.from_angles(*_angles(moved, dim, run), kv_heads) if moved else None
    moved_keys = keys[0].float() if rotation is None else rotation.apply(keys[0].float())
    positions = torch.randint(0, n, (rows,))
    q = torch.randn(rows, kv_heads * group, dim).to(dtype)
    with _threads(n_threads):
        got = cpu_kernel.paged_scores(q, k_cache, tables[0], positions, n, dim ** -0.5,
                                      torch_ref.key_rotations([rotation]))
    want = torch.einsum("thd,khd->htk", q.double(), moved_keys.double().repeat_interleave(group, 1)) * dim ** -0.5
    want = want.masked_fill(torch.arange(n)[None, None] > positions[None, :, None], float("-inf"))
    _close(got, want, torch.float32, scale=10.0 if dtype == torch.bfloat16 else 1.0)


gemm_shapes = st.tuples(st.integers(1, 600), st.integers(1, 300), st.integers(1, 200))


@PROPERTY
@given(seed=seeds, shape=gemm_shapes, n_threads=threads, with_bias=st.booleans())
def test_f32_gemm_is_the_matmul(lib, seed, shape, n_threads, with_bias):
    torch.manual_seed(seed)
    rows, k, n = shape
    x, w = torch.randn(rows, k), torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    packed, out = f32_panels(w), torch.empty(rows, n)
    with _threads(n_threads):
        status = lib.f32_gemm(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), rows, n, packed.shape[0] * 16, k)
    assert status == 0
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    _close(out, want, torch.float32, scale=k ** 0.5)


@PROPERTY
@given(seed=seeds, rows=st.integers(1, 80), groups=st.integers(1, 8), n=st.integers(1, 120),
       kind=st.sampled_from([(4, 32), (5, 32), (6, 16), (8, 32), (8, 16)]), with_offset=st.booleans(),
       with_bias=st.booleans(), factored=st.booleans(), n_threads=threads, parts=st.integers(1, 5))
def test_block_gemm_is_the_matmul_of_its_blocks(lib, seed, rows, groups, n, kind, with_offset, with_bias, factored,
                                                n_threads, parts):
    """Rows to 80 take both the direct path and the widened slices (block_gemm.c, DIRECT_MAX_ROWS);
    5-bit codes every fifth bit pattern (Q5_0's, Q5_1's); 8-bit codes in groups of 16 (Q6_K's) come
    without an offset; factored: a K-quant's int8 scales and offsets times their super-block's
    factors, over 1-2 super-blocks; 6-bit codes (Q6_K's for int8 x, code + 32) factored, their
    float x through the widened slices at any row count. A team's parts (block_gemm_part, up to
    DIRECT_MAX_ROWS rows) give the same sums to the bit, into columns of wider rows, and leave the
    columns beside untouched."""
    torch.manual_seed(seed)
    (bits, group), with_offset = kind, with_offset and kind[1] == BLOCK_GROUP
    factored = (factored and bits != 5) or bits == 6
    k = (1 + groups % 2) * BLOCK_SUPER if factored else groups * group
    x = torch.randn(rows, k)
    codes = torch.randint(0, 1 << bits, (n, k)) if bits < 8 else torch.randint(-128, 128, (n, k))
    if factored:  # Q4_K's scales and minimums are 6-bit, Q6_K's scales int8
        scale = torch.randint(0, 64, (n, k // group)) if bits == 4 else torch.randint(-128, 128, (n, k // group))
        offset = torch.randint(0, 64, (n, k // group)).to(torch.int8) if with_offset else None
        scale, factors = scale.to(torch.int8), torch.rand(n, k // BLOCK_SUPER, 2) / 512 - torch.tensor([0.0, 1 / 512])
    else:
        scale, factors = torch.rand(n, k // group) / 8, None
        offset = torch.randn(n, k // group) if with_offset else None
    bias = torch.randn(n) if with_bias else None
    packed, scales, offsets = block_panels(codes, bits, scale, offset)
    tensors = (packed, scales, offsets, None if factors is None else factor_panels(factors), bias)
    with _threads(n_threads):
        out = _block_gemm(lib, x, tensors, bits, group, n, k, 0)
    signed = codes - 32 if bits == 6 else codes  # the weights' codes
    weight = block_weight(signed, scale, offset, factors)
    want = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    size = k ** 0.5 * (weight.abs().max().item() if factored else 1.0)  # factored weights reach past 1
    _close(out, want, torch.float32, scale=size)
    if bits != 6:  # 6-bit codes have no team path for float x
        _block_gemm_parts(lib, x, tensors, bits, group, out, k, 0, parts)
    if bits in (4, 6):  # x rounded to int8 (int8_x): its twin up to the direct path's rows, else as before
        with _threads(n_threads):
            rounded = _block_gemm(lib, x, tensors, bits, group, n, k, 1)
        if rows > BLOCK_DIRECT_ROWS:
            assert torch.equal(rounded, out)
        else:
            twin = block_int8_twin(x, signed, scale, offset, factors) + (0 if bias is None else bias.double())
            _close(rounded, twin, torch.float32, scale=size)
            _block_gemm_parts(lib, x, tensors, bits, group, rounded, k, 1, parts)


def _pointers(tensors) -> list:
    """The data pointers of (packed, scales, offsets, factors, bias), None for the absent."""
    return [None if t is None else t.data_ptr() for t in tensors]


def _block_gemm(lib, x, tensors, bits, group, n, k, int8_x) -> torch.Tensor:
    """block_gemm's out [rows, n] for x over tensors (packed, scales, offsets, factors, bias),
    failing on any status but 0."""
    out = torch.empty(x.shape[0], n)
    packed, scales, offsets, factors, bias = _pointers(tensors)
    status = lib.block_gemm(x.data_ptr(), packed, bits, group, scales, offsets, factors, bias, out.data_ptr(),
                            x.shape[0], n, tensors[1].shape[0] * 16, k, int8_x)
    assert status == 0
    return out


def _block_gemm_parts(lib, x, tensors, bits, group, whole, k, int8_x, parts):
    """block_gemm_part's `parts` parts, into columns of wider rows, give `whole` to the bit and leave
    the columns beside untouched (a team's, up to the direct path's rows)."""
    rows, n = whole.shape
    if rows > BLOCK_DIRECT_ROWS:
        return
    wide = torch.full((rows, n + 5), 7.0)
    packed, scales, offsets, factors, bias = _pointers(tensors)
    for part in range(parts):
        status = lib.block_gemm_part(x.data_ptr(), packed, bits, group, scales, offsets, factors, bias,
                                     wide[:, 2:].data_ptr(), n + 5, rows, n, tensors[1].shape[0] * 16, k, int8_x,
                                     part, parts)
        assert status == 0
    assert torch.equal(wide[:, 2:n + 2], whole)
    assert (wide[:, :2] == 7).all() and (wide[:, n + 2:] == 7).all()


def test_block_gemm_refuses_what_it_does_not_take(lib):
    x, codes, scale = torch.randn(2, 64), torch.zeros(48, 64, 8, dtype=torch.uint8), torch.ones(48, 2, 16)
    out, s, none = torch.empty(2, 40), scale.data_ptr(), None

    def call(bits, group, offset, factors, n_padded, k):
        return lib.block_gemm(x.data_ptr(), codes.data_ptr(), bits, group, s, offset, factors, None, out.data_ptr(), 2,
                              40, n_padded, k, 0)

    assert call(4, 32, none, none, 48, 64) == 0
    part = functools.partial(lib.block_gemm_part, x.data_ptr(), codes.data_ptr(), 4, 32, s, None, None, None,
                             out.data_ptr())
    assert part(40, 2, 40, 48, 64, 0, 0, 1) == 0
    assert part(39, 2, 40, 48, 64, 0, 0, 1) == -1  # rows narrower than its columns
    assert part(40, BLOCK_DIRECT_ROWS + 1, 40, 48, 64, 0, 0, 1) == -1  # past the direct path: no parts
    assert part(40, 2, 40, 48, 64, 0, 0, 0) == -1 and part(40, 2, 40, 48, 64, 0, 2, 2) == -1  # no such part
    assert call(6, 32, none, none, 48, 64) == -1  # 6-bit codes by 32
    assert call(6, 16, none, none, 48, 64) == -1  # 6-bit codes, not factored
    assert call(6, 16, s, s, 48, 256) == -1  # 6-bit codes with an offset
    assert call(5, 16, s, none, 48, 64) == -1  # 5-bit codes by 16
    assert call(4, 32, none, none, 48, 60) == -1  # k not a multiple of 32
    assert call(4, 32, none, none, 32, 64) == -1  # n_padded not a tile
    assert call(8, 16, none, none, 48, 64) == 0
    assert call(8, 16, none, none, 48, 56) == -1  # k not a multiple of 16
    assert call(4, 16, s, none, 48, 64) == -1  # 4-bit codes by 16
    assert call(8, 64, none, none, 48, 64) == -1  # no such group
    assert call(8, 16, none, s, 48, 64) == -1  # factored, but k not a multiple of a super-block
    x, out = torch.randn(2, 256), torch.empty(2, 40)
    assert call(6, 16, none, s, 48, 256) == 0  # factored (6-bit codes only so) over a super-block
    assert lib.block_gemm_part(x.data_ptr(), codes.data_ptr(), 6, 16, s, None, s, None, out.data_ptr(), 40, 2, 40, 48,
                               256, 0, 0, 1) == -1  # a team's part: only with x rounded to int8


@PROPERTY
@given(seed=seeds, shape=gemm_shapes, n_threads=threads)
def test_f32_gemm_int8w_is_the_dequantized_matmul(lib, seed, shape, n_threads):
    torch.manual_seed(seed)
    rows, k, n = shape
    x = torch.randn(rows, k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) / 127
    (packed, padded), out = int8w_panels(q, scale), torch.empty(rows, n)
    with _threads(n_threads):
        status = lib.f32_gemm_int8w(x.data_ptr(), packed.data_ptr(), padded.data_ptr(), None, out.data_ptr(), rows,
                                    n, padded.shape[0], k)
    assert status == 0
    _close(out, x.double() @ (q.double() * scale.double()[:, None]).t(), torch.float32, scale=k ** 0.5)


@PROPERTY
@given(seed=seeds, shape=gemm_shapes, n_threads=threads, with_bias=st.booleans())
def test_f32_gemm_bf16w_is_the_matmul_of_the_bf16_weight(lib, seed, shape, n_threads, with_bias):
    torch.manual_seed(seed)
    rows, k, n = shape
    x, w = torch.randn(rows, k), torch.randn(n, k).bfloat16()
    bias = torch.randn(n) if with_bias else None
    packed, out = f32_panels(w), torch.empty(rows, n)
    with _threads(n_threads):
        status = lib.f32_gemm_bf16w(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), rows, n, packed.shape[0] * 16, k)
    assert status == 0
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    _close(out, want, torch.float32, scale=k ** 0.5)


@PROPERTY
@given(seed=seeds, rows=st.integers(1, 600), blocks=st.integers(1, 5), n=st.integers(1, 200), dtype=dtypes,
       n_threads=threads, with_bias=st.booleans())
def test_int8_gemm_is_its_torch_twin(lib, seed, rows, blocks, n, dtype, n_threads, with_bias):
    torch.manual_seed(seed)
    k = blocks * W8A8_BLOCK
    x = torch.randn(rows, k).to(dtype)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, bias = torch.rand(n) / 127, (torch.randn(n) if with_bias else None)
    packed, comp, padded = w8a8_panels(q, scale)
    out = torch.empty(rows, n, dtype=dtype)
    with _threads(n_threads):
        status = lib.int8_gemm(x.data_ptr(), packed.data_ptr(), comp.data_ptr(), padded.data_ptr(),
                               None if bias is None else bias.data_ptr(), out.data_ptr(), rows, n, padded.shape[0], k,
                               native.DTYPES[dtype])
    assert status == 0
    _close(out, w8a8_twin(x, q, scale, bias), dtype)


@PROPERTY
@given(seed=seeds, rows=st.integers(1, 600), width=st.integers(1, 300), dtype=dtypes, n_threads=threads)
def test_rms_norm_and_silu_mul_are_their_formulas(lib, seed, rows, width, dtype, n_threads):
    torch.manual_seed(seed)
    x, w = torch.randn(rows, width).to(dtype), torch.randn(width).to(dtype)
    gate_up = (4 * torch.randn(rows, 2 * width)).to(dtype)
    normed, silu = torch.empty_like(x), torch.empty(rows, width, dtype=dtype)
    with _threads(n_threads):
        assert lib.rms_norm(x.data_ptr(), w.data_ptr(), normed.data_ptr(), rows, width, 1e-6, native.DTYPES[dtype]) == 0
        assert lib.silu_mul(gate_up.data_ptr(), silu.data_ptr(), rows, width, native.DTYPES[dtype]) == 0
    x64 = x.double()
    _close(normed, w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6), dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    _close(silu, F.silu(gate) * up, dtype, scale=4.0)


@PROPERTY
@given(seed=seeds, data=st.data(), dtype=dtypes, n_threads=threads, tokens=st.integers(1, 40), heads=head_shapes,
       fused=st.booleans())
def test_rope_store_rotates_and_stores(lib, seed, data, dtype, n_threads, tokens, heads, fused):
    """q, k and v as views into one qkv row (strided, as the model splits them) or separate tensors."""
    torch.manual_seed(seed)
    kv_heads, group, dim = heads
    heads_q, max_position = kv_heads * group, 64
    if fused:
        qkv = torch.randn(tokens, (heads_q + 2 * kv_heads) * dim).to(dtype)
        q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads_q * dim, kv_heads * dim, kv_heads * dim], -1))
    else:
        q, k, v = (torch.randn(tokens, h, dim).to(dtype) for h in (heads_q, kv_heads, kv_heads))
    angles = torch.arange(max_position)[:, None].float() * (0.3 ** torch.arange(dim // 2).float())
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    positions = torch.tensor(data.draw(st.lists(st.integers(0, max_position - 1), min_size=tokens, max_size=tokens)))
    slots = torch.randperm(tokens + 5)[:tokens]
    cache = torch.zeros(2, tokens + 5, kv_heads, dim, dtype=dtype)
    q_out, k_out = torch.empty(q.shape, dtype=dtype), torch.empty(k.shape, dtype=dtype)
    with _threads(n_threads):
        status = lib.rope_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
                                positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), max_position, q_out.data_ptr(),
                                k_out.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), slots.data_ptr(),
                                tokens + 5, tokens, heads_q, kv_heads, dim, native.DTYPES[dtype], native.DTYPES[dtype])
    assert status == 0

    def rotated(x):  # as the model's torch path computes it: tables and each product rounded to the dtype
        c, s = cos[positions][:, None, :].to(dtype), sin[positions][:, None, :].to(dtype)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    _close(q_out, rotated(q), dtype)
    _close(k_out, rotated(k), dtype)
    _close(cache[0][slots], rotated(k), dtype)
    assert torch.equal(cache[1][slots], v)


@PROPERTY
@given(seed=seeds, data=st.data(), dtype=dtypes, blocks=st.integers(0, 60), heads=head_shapes, rows=st.integers(1, 30),
       sinks=st.integers(0, 3), recent=st.integers(0, 3), slots=st.integers(0, 40), row_pad=st.integers(0, 8))
def test_centroid_topk_picks_sinks_recent_and_the_best_scores(lib, seed, data, dtype, blocks, heads, rows, sinks,
                                                              recent, slots, row_pad):
    """Queries with a row stride (rows of a qkv projection); block ids scattered over a larger pool."""
    torch.manual_seed(seed)
    kv_heads, group, dim = heads
    heads_q = kv_heads * group
    centroids = torch.randn(blocks + 10, kv_heads, dim).to(dtype)
    block_ids = torch.randperm(blocks + 10)[:blocks]
    own = torch.tensor([blocks + 50])
    q = torch.randn(rows, heads_q * dim + row_pad).to(dtype)[:, : heads_q * dim].view(rows, heads_q, dim)
    table = torch.full((blocks + 1,), -1)
    count = cpu_kernel.centroid_topk(centroids, block_ids, own, q, sinks, recent, slots, table)
    first = min(sinks, blocks)
    last = max(blocks - recent, first)
    take = max(0, min(slots - first - (blocks - last), last - first))
    assert count == first + take + (blocks - last)
    picked = table[:count].tolist()
    assert picked[:first] == block_ids[:first].tolist() and picked[first + take:] == block_ids[last:].tolist()
    assert table[count] == own[0]
    middle = picked[first:first + take]
    order = [block_ids.tolist().index(b) for b in middle]
    assert order == sorted(order) and all(first <= i < last for i in order)
    folded = q.double().view(rows, kv_heads, group, dim).sum((0, 2)).flatten()
    scores = centroids.double().flatten(1)[block_ids[first:last]] @ folded
    chosen = torch.tensor([i - first for i in order], dtype=torch.long)
    others = torch.ones(last - first, dtype=torch.bool)
    others[chosen] = False
    if take and others.any():  # every pick scores at least every block left out (to rounding)
        slack = 1e-3 * (scores.abs().max().item() + 1)
        assert scores[chosen].min() >= scores[others].max() - slack


@PROPERTY
@given(seed=seeds, rows=st.integers(1, 600), half_k=st.integers(1, 150), n=st.integers(1, 200), n_threads=threads,
       with_bias=st.booleans())
def test_bf16_pairs_gemm_is_the_matmul_where_the_build_has_bf16_dot_products(lib, seed, rows, half_k, n, n_threads,
                                                                            with_bias):
    torch.manual_seed(seed)
    k = 2 * half_k
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    bias = torch.randn(n) if with_bias else None
    packed, out = pair_panels(w), torch.empty(rows, n)
    with _threads(n_threads):
        status = lib.bf16_pairs_gemm(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                     out.data_ptr(), rows, n, packed.shape[0] * 16, k)
    if status == -2:  # a build without AVX-512 BF16: the widening GEMM's
        return
    assert status == 0
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    _close(out, want, torch.float32, scale=k ** 0.5)



def test_fused_layers_answer_as_the_python_layers(lib, tiny_qwen2_blocks_path):
    """The whole-step kernel (fused_layers.c) on this build, against the model's Python layers on
    the same build's kernels, to the bit: prefill chunks over documents read in a new order (span
    keys moved), the focus probe's runs, decode steps of one row (one team) and of 26 (each kernel
    on its own threads)."""
    fused, moved = _greedy_answers(tiny_qwen2_blocks_path, fused=True)
    python, _ = _greedy_answers(tiny_qwen2_blocks_path, fused=False)
    assert moved and fused == python


def _greedy_answers(path, fused: bool) -> tuple[list, bool]:
    """Tokens and logprobs of a fresh engine's answers, and whether the fused layers took a prefill
    step over moved span keys."""
    from spanserve import LLM, SamplingParams, Span

    llm = LLM(model=str(path), dtype="float32", num_blocks=256)
    model = llm.engine.runner.model
    assert model.fused_layers is not None
    calls = record_fused_layers(model)
    if not fused:
        model.fused_layers = None
    docs = ["alpha beta gamma delta epsilon " * 5, "one two three four five six " * 4, "red green blue " * 9]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2)
    outs = [o for order in ([0, 1, 2], [2, 0, 1]) for o in
            llm.generate([[*(Span(docs[i]) for i in order), "Which colours?"]], params)]
    outs += llm.generate([f"Count to {i}:" for i in range(26)], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], any(
        taken and prefill and moved for taken, prefill, moved, _ in calls)
