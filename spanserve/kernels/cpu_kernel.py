"""Attention over the paged cache in one C call on CPU: decode (csrc/paged_decode.c) and prefill
chunks (csrc/paged_prefill.c).

The torch path gathers every decoding sequence's keys and values into padded copies, then runs
two matmuls and a masked softmax: per layer, several ops and two copies of the whole context
(padding included). The C kernel reads the cache blocks in place, chunk by chunk of each
sequence with an online softmax in float32, on the OpenMP threads torch uses: attention 11-12
ms a step against 19-21 for 8 sequences of mixed length decoding here.

The prefill kernel is flash attention over the same blocks: the queries of a chunk, each seeing
the keys up to its position, with no gathered copy of the context and no score matrix or mask
(the torch path's two matmuls, mask and softmax passes over [queries x keys]).

Warm-up: after half a millisecond or more without 512-bit vector work (Python, small torch ops),
this machine's cores run the next kernel's first few hundred microseconds slowly (the wide units
powered down): the same prefill call over 1,050 keys took 0.35 ms longer on one thread after a
0.6 ms Python pause than back to back, and not after a pause of small matmuls (one-off timing).
Work between a step's kernels is kept short for that too (sparse/builtins.py).

Both come from spanserve's C library (spanserve/kernels/native.py), built on first use. Without a
compiler, or with SPANSERVE_CPU_KERNELS=0, attention keeps the torch path; the reason is logged
once. SPANSERVE_CPU_KERNELS=decode (or prefill, layer: models/layer_ops.py, gemm:
models/layout.py, sparse: centroid_topk below) keeps the kernels it names and gives the others'
work to the torch path, to compare them.
"""

import ctypes
import logging
import os
import threading
from contextlib import contextmanager

import torch

from spanserve.kernels import native

log = logging.getLogger(__name__)

MAX_DIM = 512  # its merge buffer (paged_decode.c)

KERNELS = ("decode", "prefill", "layer", "gemm", "sparse")  # what SPANSERVE_CPU_KERNELS may name

_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None  # the library, its entry points typed
_allowed: frozenset[str] = frozenset(KERNELS)
_tried = False
_failure: str | None = None  # why the library is not used, where it is not


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of one query per sequence, q [B, heads, D], over its first context_lens[b] cached
    keys (k_cache, v_cache [num_blocks, block_size, kv_heads, D]; block_tables [B, max_blocks]
    int64). None where the kernel cannot run it (not built, other device or dtype, odd shapes):
    the caller then takes the torch path."""
    if not _fits(q, k_cache, v_cache):
        return None
    kernel = load("decode")
    if kernel is None:
        return None
    q, tables, lens = q.contiguous(), block_tables.long().contiguous(), context_lens.long().contiguous()
    out = torch.empty_like(q)
    num_seqs, heads, dim = q.shape
    status = kernel.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                 tables.data_ptr(), lens.data_ptr(), num_seqs, tables.shape[1], heads, k_cache.shape[2],
                                 dim, k_cache.shape[1], scale, native.DTYPES[q.dtype],
                                 native.DTYPES[k_cache.dtype])
    _raise_on(status, "paged_decode", q, k_cache)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_starts: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                  scale: float, out: torch.Tensor | None = None,
                  rotations: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Attention of the query rows q [T, heads, D] of B sequences (sequence b owns rows
    query_starts[b] .. query_starts[b + 1] - 1, [B + 1]), query t seeing its sequence's cached keys
    0 .. positions[t] ([T]) of the first context_lens[b] (block_tables [B, max_blocks]), into `out`
    (contiguous, like q) or a new tensor. `rotations` (from key_rotations): angles that move each
    sequence's first keys as they are read. None where the kernel cannot run it: the caller then
    takes the torch path."""
    if not _fits(q, k_cache, v_cache):
        return None
    kernel = load("prefill")
    if kernel is None:
        return None
    q, tables = q.contiguous(), block_tables.long().contiguous()
    starts, positions, lens = (t.long().contiguous() for t in (query_starts, positions, context_lens))
    if out is None or not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        out = torch.empty_like(q)
    rows, heads, dim = q.shape
    rot_starts, rot_ids, rot_cos, rot_sin, num_angles = rotation_args(rotations)
    status = kernel.paged_prefill(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                  tables.data_ptr(), starts.data_ptr(), positions.data_ptr(), lens.data_ptr(),
                                  rot_starts, rot_ids, rot_cos, rot_sin, num_angles, len(lens), rows,
                                  tables.shape[1], heads, k_cache.shape[2], dim, k_cache.shape[1], scale,
                                  native.DTYPES[q.dtype], native.DTYPES[k_cache.dtype])
    _raise_on(status, "paged_prefill", q, k_cache)
    return out


def paged_scores(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                 context_len: int, scale: float,
                 rotations: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
    """The scaled scores, before the softmax, of one sequence's few query rows q [T, heads, D]
    (at `positions` [T]) against its first context_len cached keys (block_table [max_blocks];
    `rotations` from key_rotations, for this one sequence), as [heads, T, context_len] float32,
    -inf where a key stands after a row's position. None where the kernel cannot run it."""
    if not _fits(q, k_cache, k_cache) or q.shape[0] * q.shape[1] // k_cache.shape[2] > 256:  # its TILE_ROWS
        return None
    kernel = load("prefill")
    if kernel is None:
        return None
    q, table, positions = q.contiguous(), block_table.long().contiguous(), positions.long().contiguous()
    rows, heads, dim = q.shape
    scores = torch.empty(heads, rows, context_len)
    rot_starts, rot_ids, rot_cos, rot_sin, num_angles = rotation_args(rotations)
    status = kernel.paged_scores(q.data_ptr(), k_cache.data_ptr(), scores.data_ptr(), table.data_ptr(),
                                 positions.data_ptr(), context_len, rot_starts, rot_ids, rot_cos, rot_sin, num_angles,
                                 rows, table.shape[0], heads, k_cache.shape[2], dim, k_cache.shape[1], scale,
                                 native.DTYPES[q.dtype], native.DTYPES[k_cache.dtype])
    _raise_on(status, "paged_scores", q, k_cache)
    return scores


def centroid_topk(centroids: torch.Tensor, block_ids: torch.Tensor, own: torch.Tensor, q: torch.Tensor,
                  sinks: int, recent: int, slots: int, table: torch.Tensor) -> int | None:
    """Block top-k's picks (csrc/block_pick.c) written into `table` (int64, contiguous): the ids,
    in order, of the `sinks` first blocks of block_ids [n], the `recent` last and the best others
    by centroid . (q summed over its rows and query heads), `slots` in all at most, then `own`; how
    many of block_ids it picked. centroids [pool_blocks, kv_heads, D] (one layer's), q [rows,
    heads, D] (the step's queries of the sequence). None where the kernel cannot run these: the
    caller then takes the torch path."""
    if centroids.device.type != "cpu" or centroids.dtype not in native.DTYPES or not centroids.is_contiguous() \
            or q.dtype not in native.DTYPES or q.stride(2) != 1 or q.stride(1) != q.shape[2] \
            or not all(t.dtype == torch.long and t.is_contiguous() for t in (block_ids, own, table)):
        return None
    kernel = load("sparse")
    if kernel is None:
        return None
    (rows, heads, dim), kv_heads, num = q.shape, centroids.shape[1], block_ids.shape[0]
    if table.shape[0] < num + own.shape[0]:
        raise ValueError(f"a table of {table.shape[0]} ids cannot hold {num} blocks and {own.shape[0]} more")
    count = kernel.centroid_topk(centroids.data_ptr(), native.DTYPES[centroids.dtype], block_ids.data_ptr(), num,
                                 own.data_ptr(), own.shape[0], q.data_ptr(), native.DTYPES[q.dtype], rows, heads,
                                 kv_heads, dim, q.stride(0), sinks, recent, slots, table.data_ptr())
    if count < 0:
        raise RuntimeError(f"centroid_topk failed: {num} blocks, queries {tuple(q.shape)}")
    return count - own.shape[0]


def rotation_args(rotations: tuple[torch.Tensor, ...] | None) -> tuple:
    """key_rotations' tensors as the kernels take them: their pointers (starts, ids, cos, sin), then
    how many distinct angles; NULLs and 0 where no key moves."""
    if rotations is None:
        return None, None, None, None, 0
    return (*(t.data_ptr() for t in rotations), len(rotations[2]))


def _raise_on(status: int, name: str, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if status != 0:  # -1 shapes, -2 lengths or positions, -3 out of memory
        raise RuntimeError(f"{name} failed ({status}): q {tuple(q.shape)} over a cache of {tuple(k_cache.shape)}")


def _fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    kv_heads, dim = k_cache.shape[2:]
    return (q.device.type == "cpu" and q.dtype in native.DTYPES and k_cache.dtype in native.DTYPES
            and k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.shape[1] % kv_heads == 0 and dim <= MAX_DIM)


def load(name: str | None = None):
    """The compiled kernels (a library with typed entry points), built on first call; None if they
    cannot be, or if `name` (decode, prefill, layer, gemm) is not one SPANSERVE_CPU_KERNELS lets run. A value
    it does not know is an error (ValueError), raised at the engine's start."""
    global _kernel, _allowed, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _allowed = _kernels_allowed(os.environ.get("SPANSERVE_CPU_KERNELS", "1"))
                if not _allowed:
                    log.info("SPANSERVE_CPU_KERNELS=0: attention takes the torch path")
                else:
                    _kernel = _built()
                _tried = True  # after _kernel: a thread that sees it set sees the kernel too
    # decided: no lock on the hot path (every attention layer asks)
    return _kernel if name is None or name in _allowed else None


@contextmanager
def only_kernels(names: set[str]):
    """Within: of the kernels allowed, only `names` run; the others' work takes the torch path (to
    compare the two in one process: benchmarks/sparse_pick.py). Not for use while another thread steps."""
    global _allowed
    load()
    before = _allowed
    _allowed = before & frozenset(names)
    try:
        yield
    finally:
        _allowed = before


@contextmanager
def using(library):
    """Within: the kernels are those of `library` (native.library_at: another build), to compare
    builds in one process (benchmarks/prefill_attention.py). Not for use while another thread steps."""
    global _kernel
    load()
    before = _kernel
    _kernel = library
    try:
        yield
    finally:
        _kernel = before


def _kernels_allowed(value: str) -> frozenset[str]:
    value = value.strip().lower()
    if value in ("", "1"):
        return frozenset(KERNELS)
    names = frozenset(part.strip() for part in value.split(",")) - {""}
    if value == "0" or not names:
        return frozenset()
    if not names <= set(KERNELS):
        raise ValueError(f"SPANSERVE_CPU_KERNELS={value!r}: use 1 (all), 0 (none) or a comma list of "
                         f"{', '.join(KERNELS)}")
    return names


def unavailable_reason(name: str = "gemm") -> str:
    """Why load(name) gives None, for a log line ("" where it does not)."""
    load()
    if _kernel is not None and name in _allowed:
        return ""
    if _kernel is None and _allowed:
        return _failure or "not built"
    return f"SPANSERVE_CPU_KERNELS={os.environ.get('SPANSERVE_CPU_KERNELS', '')!r} leaves out {name!r}"


def _built() -> ctypes.CDLL | None:
    global _failure
    try:
        lib = native.library()
        log.info("C kernels: %s", ", ".join(sorted(_allowed)))
        return lib
    except native.NativeUnavailable as exc:
        _failure = f"the C kernels could not be used: {exc}"
        log.warning("%s; attention, layer ops and projections take the torch path", _failure)
        return None
