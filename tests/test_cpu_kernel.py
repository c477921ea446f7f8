"""The C attention kernels (kernels/csrc/paged_decode.c, paged_prefill.c) against a plain softmax
attention, the torch paths they stand in for, and their fallbacks."""

import logging

import pytest
import torch
from test_attention import reference

from spanserve.attention import AttentionMetadata, KeyRotation, torch_ref
from spanserve.attention.torch_ref import TorchAttention
from spanserve.kernels import cpu_kernel, native

needs_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")


def paged(lens, block_size, kv_heads, dim, dtype, seed=0):
    """Keys and values of sequences with `lens` tokens in shuffled blocks of one cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=dtype)
    width = max(-(-n // block_size) for n in lens)
    tables, contexts = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        keys, values = (torch.randn(n, kv_heads, dim, generator=gen) * 2 for _ in range(2))
        slots = [table[t // block_size] * block_size + t % block_size for t in range(n)]
        cache[0].view(-1, kv_heads, dim)[slots] = keys.to(dtype)
        cache[1].view(-1, kv_heads, dim)[slots] = values.to(dtype)
        tables.append(table + [0] * (width - len(table)))
        contexts.append((keys.to(dtype), values.to(dtype)))
    return cache, torch.tensor(tables), contexts


@needs_kernel
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2**-8)])
# dims that are multiples of 16 take the vector path (blocks of 32: two key groups each), 20 the scalar
# one; groups of 1 to 7 query heads per KV head (weighed 3 at a time: 7 = 3 + 3 + 1, 4 = 3 + 1)
@pytest.mark.parametrize("block_size, heads, kv_heads, dim",
                         [(16, 9, 3, 64), (4, 4, 4, 16), (8, 12, 2, 128), (32, 6, 2, 32), (16, 4, 2, 20),
                          (16, 14, 2, 64), (16, 16, 4, 32)])
def test_kernel_equals_the_reference(dtype, tolerance, block_size, heads, kv_heads, dim):
    """Contexts of one key, part of a block, and several chunks of 16 blocks (merged by flash
    decoding), each query seeing its whole context; in bf16, within the rounding of the output
    (scores and sums are float32)."""
    lens = [1, block_size + 3, 16 * block_size * 2 + 5, 7]
    cache, tables, contexts = paged(lens, block_size, kv_heads, dim, dtype)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    out = cpu_kernel.paged_decode(q, cache[0], cache[1], tables, torch.tensor(lens), 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    for i, (keys, values) in enumerate(contexts):
        expected = reference(q[i:i + 1].float(), keys.float(), values.float(), torch.tensor([lens[i] - 1]), 0.3)
        torch.testing.assert_close(out[i].double(), expected[0], rtol=tolerance, atol=tolerance)


def ramped(ramp: str, n: int, kv_heads: int, dim: int):
    """One sequence of n keys in 16-token blocks whose scale rises from 0.2 to 6 along the context
    ("rising") or falls from 6 ("falling"): (cache, tables, keys, values)."""
    cache, tables, contexts = paged([n], 16, kv_heads, dim, torch.float32, seed=3)
    scale = torch.linspace(0.2, 6.0, n)
    scale = scale if ramp == "rising" else scale.flip(0)
    slots = [int(tables[0, t // 16]) * 16 + t % 16 for t in range(n)]
    keys = contexts[0][0] * scale[:, None, None]
    cache[0].view(-1, kv_heads, dim)[slots] = keys
    return cache, tables, keys, contexts[0][1]


@needs_kernel
@pytest.mark.parametrize("ramp", ["rising", "falling"])
def test_decode_softmax_follows_scores_far_apart(ramp):
    """The decode kernel keeps each head's softmax relative to a reference that moves only when a
    score passes it (RESCALE_SLACK in csrc/paged_decode.c): keys whose scores climb past it block
    after block (rescaled many times), or start high and fall tens of units below (weights far
    under the reference), give the plain softmax."""
    lens, heads = [16 * 40 + 9], 6
    cache, tables, keys, values = ramped(ramp, lens[0], kv_heads=2, dim=32)
    q = torch.randn(1, heads, 32, generator=torch.Generator().manual_seed(5)) * 2
    out = cpu_kernel.paged_decode(q, cache[0], cache[1], tables, torch.tensor(lens), 0.5)
    expected = reference(q, keys, values, torch.tensor([lens[0] - 1]), 0.5)
    # scores reach the hundreds, whose float32 rounding (3e-5 at 300) the weights inherit: the
    # kernel before lazy rescaling was off by as much (up to 3.4e-5 over 200 queries)
    torch.testing.assert_close(out[0].double(), expected[0], rtol=1e-4, atol=1e-4)


def decode_meta(lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """A step of one decode token per sequence, each the last of its context."""
    slots = [int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), query_lens=[1] * len(lens), context_lens=lens,
                             block_tables=tables, context_lens_tensor=torch.tensor(lens),
                             positions=torch.tensor(lens) - 1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_gives_what_the_torch_path_gives(monkeypatch, dtype):
    """TorchAttention's decode step, with the kernel and without it (two matmuls over gathered,
    padded keys): the same in float32; in bf16, where the torch path rounds its scores to bf16,
    the kernel is the closer of the two to a float64 softmax."""
    lens = [40, 3, 300]
    cache, tables, _ = paged(lens, 16, 2, 32, dtype, seed=1)
    q, k, v = torch.randn(3, 6, 32).to(dtype), torch.randn(3, 2, 32).to(dtype), torch.randn(3, 2, 32).to(dtype)
    with_kernel = TorchAttention().forward(q, k, v, cache, decode_meta(lens, tables), 0.2)
    monkeypatch.setattr(torch_ref, "paged_decode", lambda *args: None)
    without = TorchAttention().forward(q, k, v, cache, decode_meta(lens, tables), 0.2)
    expected = []
    for i, n in enumerate(lens):  # the cache now holds the step's keys too
        keys, values = (part[tables[i]].flatten(0, 1)[:n].float() for part in cache)
        expected.append(reference(q[i:i + 1].float(), keys, values, torch.tensor([n - 1]), 0.2)[0])
    assert_kernel_as_close(with_kernel, without, torch.stack(expected))


def assert_kernel_as_close(with_kernel: torch.Tensor, without: torch.Tensor, expected: torch.Tensor,
                           bf16_bound: float = 2e-2) -> None:
    """float32: both within 1e-5 of a float64 softmax; bf16, where the torch paths round their
    scores to bf16: the kernel at least as close as the torch path, and within `bf16_bound`."""
    errors = [(out.double() - expected).abs().max() for out in (with_kernel, without)]
    if with_kernel.dtype == torch.float32:
        assert max(errors) < 1e-5
    else:
        assert errors[0] <= errors[1] and errors[0] < bf16_bound


@needs_kernel
def test_the_kernel_leaves_denormals_alone_outside_it():
    """It flushes denormals to zero while it runs, and only then: a temperature of 1e-38 (a
    float32 denormal) must stay what it is for the sampler."""
    cache, tables, _ = paged([20], 4, 1, 8, torch.float32)
    cpu_kernel.paged_decode(torch.randn(1, 2, 8), cache[0], cache[1], tables, torch.tensor([20]), 1.0)
    assert torch.tensor([1e-38]).item() != 0.0 and (torch.tensor([1e-38]) * 2).item() != 0.0


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """The kernel as if never loaded, built into an empty cache directory."""
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_kernel", None)
    monkeypatch.setattr(cpu_kernel, "_allowed", frozenset(cpu_kernel.KERNELS))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setenv("SPANSERVE_CACHE_DIR", str(tmp_path))


def test_without_a_compiler_decode_takes_the_torch_path_and_says_why(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="spanserve.kernels.cpu_kernel"):
        assert cpu_kernel.load() is None
    assert "no C compiler" in caplog.text and "torch path" in caplog.text
    cache, tables, _ = paged([5], 4, 1, 8, torch.float32)
    assert cpu_kernel.paged_decode(torch.randn(1, 2, 8), cache[0], cache[1], tables, torch.tensor([5]), 1.0) is None


def test_spanserve_cpu_kernels_0_turns_it_off(fresh_kernel, monkeypatch):
    monkeypatch.setenv("SPANSERVE_CPU_KERNELS", "0")
    assert cpu_kernel.load() is None


@needs_kernel
def test_spanserve_cpu_kernels_can_keep_one_kernel(fresh_kernel, monkeypatch):
    """=decode: decode takes the kernel, prefill chunks the torch path (to compare the two)."""
    monkeypatch.setenv("SPANSERVE_CPU_KERNELS", "decode")
    q, cache, tables, _, starts, positions, lens = prefill_case(torch.float32)
    assert cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, starts, positions, lens, 1.0) is None
    assert cpu_kernel.paged_decode(q[:5], cache[0], cache[1], tables, lens, 1.0) is not None


def test_an_unknown_spanserve_cpu_kernels_value_is_an_error(fresh_kernel, monkeypatch):
    monkeypatch.setenv("SPANSERVE_CPU_KERNELS", "decode,flash")
    with pytest.raises(ValueError, match="SPANSERVE_CPU_KERNELS='decode,flash'"):
        cpu_kernel.load()


@needs_kernel
def test_a_build_is_cached_by_source_and_flags(fresh_kernel):
    first = native.build()
    assert first.exists() and native.build() == first
    assert cpu_kernel.load() is not None


@needs_kernel
def test_a_context_longer_than_its_block_table_is_refused():
    cache, tables, _ = paged([5], 4, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match="failed"):
        cpu_kernel.paged_decode(torch.randn(1, 2, 8), cache[0], cache[1], tables, torch.tensor([9]), 1.0)


def test_inputs_the_kernel_cannot_read_go_to_the_torch_path():
    cache, tables, _ = paged([5], 4, 2, 8, torch.float16)
    assert cpu_kernel.paged_decode(torch.randn(1, 4, 8).half(), cache[0], cache[1], tables, torch.tensor([5]),
                                   1.0) is None  # float16: not a kernel dtype
    cache, tables, _ = paged([5], 4, 3, 8, torch.float32)
    assert cpu_kernel.paged_decode(torch.randn(1, 4, 8), cache[0], cache[1], tables, torch.tensor([5]),
                                   1.0) is None  # 4 query heads over 3 KV heads


def prefill_case(dtype, block_size=16, heads=9, kv_heads=3, dim=64, seed=0):
    """Chunks of four sequences over their cached contexts: a whole prompt (in several tiles of
    query rows at every group size), a chunk after a prefix, a chunk whose queries skip positions
    (as a prompt after spans does), a long context (its keys split across tasks) and a chunk of
    one query."""
    lens = [300, block_size + 3, 1500, 7, 300]
    q_positions = [torch.arange(300), torch.tensor([block_size + 1, block_size + 2]),
                   torch.tensor([3, 9, 200, 201, 202, 900, 1499]), torch.tensor([6]), torch.arange(260, 300)]
    cache, tables, contexts = paged(lens, block_size, kv_heads, dim, dtype, seed)
    starts = torch.tensor([0, *map(len, q_positions)]).cumsum(0)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    return q, cache, tables, contexts, starts, torch.cat(q_positions), torch.tensor(lens)


@pytest.fixture(params=["widened", "bf16 dot products"])
def bf16_prefill(request):
    """Each C path of bf16 prefill attention in turn: keys and values widened to float32, or bf16
    dot products where the build has them. The second rounds the softmax's weights to bf16 (as a
    GPU flash attention rounds P), and a moved key after its rotation: each product may be off by
    a few more of bf16's ulps than the output's rounding alone. Yields the factor on the bf16
    tolerance: 1 for the widened path, 4 for the dot products."""
    kernel = cpu_kernel.load()
    dot = request.param != "widened"
    if kernel is not None and not kernel.set_prefill_bf16_dot(int(dot)) and dot:
        pytest.skip("no bf16 dot products in this build (no AVX-512 BF16)")
    yield 4.0 if dot else 1.0
    if kernel is not None:
        kernel.set_prefill_bf16_dot(1)  # the library's default


@needs_kernel
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-5), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("block_size, heads, kv_heads, dim", [(16, 9, 3, 64), (4, 4, 4, 16), (8, 12, 2, 128),
                                                              (16, 14, 2, 64), (16, 3, 1, 20), (5, 6, 2, 32)])
def test_prefill_kernel_equals_the_reference(dtype, tolerance, block_size, heads, kv_heads, dim, bf16_prefill):
    """Each query sees its context's keys up to its own position; float32 within the error of
    float32 arithmetic over these contexts (the torch path's too), bf16 within the output's
    rounding (and the weights', bf16_prefill). A head size that is no multiple of 8 and groups of
    1 to 7 heads included, and blocks smaller than a panel of keys and no divisor of it."""
    tolerance *= bf16_prefill if dtype == torch.bfloat16 else 1.0
    q, cache, tables, contexts, starts, positions, lens = prefill_case(dtype, block_size, heads, kv_heads, dim)
    out = cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, starts, positions, lens, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    for i, (keys, values) in enumerate(contexts):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = reference(q[rows].float(), keys.float(), values.float(), positions[rows], 0.3)
        torch.testing.assert_close(out[rows].double(), expected, rtol=tolerance, atol=tolerance)


def documents_moved(n: int, dim: int, document: int, gen) -> KeyRotation:
    """The first n keys moved as reused documents of `document` keys are: each by its own distance
    (a document of 1: each key its own way), the second not at all."""
    distances = torch.randint(-900, 900, (-(-n // document),), generator=gen)
    distances[1] = 0
    distances = distances.repeat_interleave(document)[:n, None].float()
    angles = distances * 10000.0 ** (-torch.arange(dim // 2) / (dim // 2))
    return KeyRotation.from_angles(angles.cos(), angles.sin(), 3)


@needs_kernel
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-5), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("dim", [64, 48])  # (the dot products rotate a head of 48 element by element)
def test_prefill_kernel_rotates_moved_keys_as_it_reads_them(dtype, tolerance, dim, bf16_prefill):
    """Span keys cached at the positions they were computed at: the first keys of some sequences
    move by their own angles (KeyRotation, as the runner makes them), the cache is left as it
    was, and each query sees the moved keys. Keys that each move their own way are rotated as
    they are read; a reused document's keys all move alike, and a long enough run of them is read
    as stored by queries moved the other way: sequence 2's 7 rows over documents of 250 keys (not
    whole panels: panels across two documents take the first way), with a run that does not move."""
    tolerance *= bf16_prefill if dtype == torch.bfloat16 else 1.0
    q, cache, tables, contexts, starts, positions, lens = prefill_case(dtype, dim=dim)
    before = cache.clone()
    gen = torch.Generator().manual_seed(5)
    rotations = [None] * len(contexts)
    for i, moved, document in ((0, 33, 1), (2, 1200, 250), (4, 17, 1)):
        rotations[i] = documents_moved(moved, dim, document, gen)
    out = cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, starts, positions, lens, 0.3,
                                   rotations=torch_ref.key_rotations(rotations))
    assert torch.equal(cache, before)
    for i, (keys, values) in enumerate(contexts):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        keys = keys.float() if rotations[i] is None else rotations[i].apply(keys.float())
        if dtype == torch.bfloat16 and bf16_prefill > 1:  # the dot products read a moved key rounded to bf16
            keys = keys.bfloat16().float()
        expected = reference(q[rows].float(), keys, values.float(), positions[rows], 0.3)
        torch.testing.assert_close(out[rows].double(), expected, rtol=tolerance, atol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("document", [1, 250])
def test_scores_kernel_gives_each_rows_scaled_scores_before_the_softmax(dtype, document):
    """The focus probe's scores: a few rows (one mid-context) against a sequence's keys, the first
    1,200 moved; each (head, row, key) score scaled, -inf after the row's position."""
    cache, tables, [(keys, _)] = paged([1500], 16, 3, 64, dtype)
    gen = torch.Generator().manual_seed(4)
    rotation = documents_moved(1200, 64, document, gen)
    positions = torch.tensor([700, 1495, 1496, 1499])
    q = torch.randn(4, 9, 64, generator=gen).to(dtype)
    got = cpu_kernel.paged_scores(q, cache[0], tables[0], positions, 1500, 0.3, torch_ref.key_rotations([rotation]))
    moved = rotation.apply(keys.float()).double().repeat_interleave(3, 1)
    want = torch.einsum("thd,khd->htk", q.double(), moved) * 0.3
    want = want.masked_fill(torch.arange(1500)[None, None] > positions[None, :, None], float("-inf"))
    assert got.shape == (9, 4, 1500) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-3 if dtype == torch.bfloat16 else 2e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("ramp", ["rising", "falling"])
def test_prefill_softmax_follows_scores_far_apart(ramp):
    """The prefill kernel's rows keep their softmax relative to references that move only when a
    score passes them (RESCALE_SLACK, csrc/common.h), lane by lane: keys whose scores climb (the
    references move often) or fall tens of units (weights far under them), read by queries at
    many positions, in key ranges split over tasks and merged, give the plain softmax."""
    lens, heads, dim = [16 * 60 + 9], 9, 64
    cache, tables, keys, values = ramped(ramp, lens[0], kv_heads=3, dim=dim)
    positions = torch.cat([torch.tensor([0, 5, 17, 300]), torch.arange(lens[0] - 26, lens[0])])
    q = torch.randn(len(positions), heads, dim, generator=torch.Generator().manual_seed(5)) * 2
    out = cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, torch.tensor([0, len(positions)]), positions,
                                   torch.tensor(lens), 0.5)
    expected = reference(q, keys, values, positions, 0.5)
    # scores reach the hundreds, whose float32 rounding (3e-5 at 300) the weights inherit
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (9, 3, 64), (12, 2, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_do_not_depend_on_the_rows_beside_them(heads, kv_heads, dim, threads):
    """The last queries of a prompt computed after a prefix-cache hit (a short chunk over the cached
    keys) give exactly the bits the whole prompt's prefill gives them, whatever rows share their
    vector lanes and register blocks."""
    n, tail = 200, 8
    cache, tables, contexts = paged([n], 16, kv_heads, dim, torch.float32, seed=4)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, torch.tensor([0, n]), torch.arange(n),
                                         torch.tensor([n]), 0.25)
        chunk = cpu_kernel.paged_prefill(q[n - tail:].contiguous(), cache[0], cache[1], tables,
                                         torch.tensor([0, tail]), torch.arange(n - tail, n), torch.tensor([n]), 0.25)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole[n - tail:], chunk)


def prefill_meta(q_positions: list[torch.Tensor], lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """A step of prefill chunks (and decode tokens: one position), each query written at its
    position's slot."""
    slots = [int(tables[i, p // 16]) * 16 + p % 16 for i, ps in enumerate(q_positions) for p in ps.tolist()]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), query_lens=[len(p) for p in q_positions],
                             context_lens=lens, block_tables=tables, context_lens_tensor=torch.tensor(lens),
                             positions=torch.cat(q_positions))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_step_gives_what_the_torch_path_gives(monkeypatch, dtype, bf16_prefill):
    """TorchAttention over a step mixing prefill chunks (a long one whose first 100 keys move, as
    span keys do; a short one over a short context, which the torch path pads into one call with
    the decode token) and a decode token, with the kernels and without them: both close to a
    float64 softmax, the kernel at least as close (float32: within 1e-5 of each other)."""
    lens = [300, 20, 41]
    q_positions = [torch.arange(250, 300), torch.arange(0, 20), torch.tensor([40])]
    cache, tables, _ = paged(lens, 16, 2, 32, dtype, seed=2)
    rows = sum(map(len, q_positions))
    q, k, v = (torch.randn(rows, n, 32).to(dtype) for n in (6, 2, 2))
    angles = torch.rand(100, 16) * 6.28
    moved = KeyRotation.from_angles(angles.cos(), angles.sin(), 2)

    def step():
        meta = prefill_meta(q_positions, lens, tables)
        meta.key_rotation = [moved, None, None]
        return TorchAttention().forward(q, k, v, cache, meta, 0.2)

    with_kernel = step()
    monkeypatch.setattr(torch_ref, "paged_prefill", lambda *args: None)
    monkeypatch.setattr(torch_ref, "paged_decode", lambda *args: None)
    without = step()
    expected, start = [], 0
    for i, (n, positions) in enumerate(zip(lens, q_positions)):  # the cache now holds the step's keys too
        keys, values = (part[tables[i]].flatten(0, 1)[:n].float() for part in cache)
        keys = moved.apply(keys) if i == 0 else keys
        expected.append(reference(q[start:start + len(positions)].float(), keys, values, positions, 0.2))
        start += len(positions)
    assert_kernel_as_close(with_kernel, without, torch.cat(expected), 2e-2 * bf16_prefill)


@needs_kernel
def test_prefill_positions_outside_the_context_are_refused():
    q, cache, tables, _, starts, positions, lens = prefill_case(torch.float32)
    with pytest.raises(RuntimeError, match="paged_prefill failed"):
        cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, starts, positions + 10, lens, 1.0)
    with pytest.raises(RuntimeError, match="paged_prefill failed"):  # rows that are not the queries'
        cpu_kernel.paged_prefill(q, cache[0], cache[1], tables, starts - 1, positions, lens, 1.0)


@needs_kernel
def test_greedy_generation_is_the_same_with_and_without_the_kernels(default_model_path, monkeypatch):
    """The real model in float32, three prompts together, one of them prefilled in chunks over
    its cached keys: the same greedy tokens, and logprobs within 1e-3."""
    from spanserve import LLM, SamplingParams

    prompts = ["The capital of France is", "List three colours:",
               "Summarize this: " + " ".join(f"Item {i} costs {i * 7 % 13} dollars." for i in range(30))]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    llm = LLM(model=str(default_model_path), dtype="float32", num_blocks=96, max_num_batched_tokens=128,
              enable_prefix_caching=False)
    with_kernel = llm.generate(prompts, params)
    monkeypatch.setattr(torch_ref, "paged_decode", lambda *args: None)
    monkeypatch.setattr(torch_ref, "paged_prefill", lambda *args: None)
    without = llm.generate(prompts, params)
    for a, b in zip(with_kernel, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert max(abs(la[t] - lb[t]) for t in la if t in lb) < 1e-3
