"""Decode attention over the paged cache in one C call on CPU (csrc/paged_decode.c).

The torch path gathers every decoding sequence's keys and values into padded copies, then runs
two matmuls and a masked softmax: per layer, several ops and two copies of the whole context
(padding included). The C kernel reads the cache blocks in place, chunk by chunk of each
sequence with an online softmax in float32, on the OpenMP threads torch uses: attention 11-12
ms a step against 19-21 for 8 sequences of mixed length decoding here.

It is compiled on first use with the system C compiler (gcc or $CC, -march=native for this CPU)
into spanserve's cache directory, and called through ctypes: no Python headers, no build
step at install. Without a compiler, or with SPANSERVE_CPU_KERNELS=0, decode keeps the torch
path; the reason is logged once.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from spanserve.models.loader import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# Compiled with -ffast-math (for glibc's vector expf), linked without it: gcc 12 links a shared
# library built with it to code that sets flush-to-zero for the whole process at load.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # what the kernel reads and writes
MAX_DIM = 512  # its merge buffer (paged_decode.c)

_lock = threading.Lock()
_kernel: ctypes._CFuncPtr | None = None
_tried = False


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of one query per sequence, q [B, heads, D], over its first context_lens[b] cached
    keys (k_cache, v_cache [num_blocks, block_size, kv_heads, D]; block_tables [B, max_blocks]
    int64). None where the kernel cannot run it (not built, other device or dtype, odd shapes):
    the caller then takes the torch path."""
    if not _fits(q, k_cache, v_cache):
        return None
    kernel = load()
    if kernel is None:
        return None
    q, tables, lens = q.contiguous(), block_tables.long().contiguous(), context_lens.long().contiguous()
    out = torch.empty_like(q)
    num_seqs, heads, dim = q.shape
    status = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
                    lens.data_ptr(), num_seqs, tables.shape[1], heads, k_cache.shape[2], dim, k_cache.shape[1],
                    scale, DTYPES[q.dtype])
    if status != 0:  # -1 shapes, -2 context lengths, -3 out of memory
        raise RuntimeError(f"paged_decode failed ({status}): q {tuple(q.shape)} over a cache of {tuple(k_cache.shape)}")
    return out


def _fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    kv_heads, dim = k_cache.shape[2:]
    return (q.device.type == "cpu" and q.dtype in DTYPES and k_cache.dtype == q.dtype == v_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.shape[1] % kv_heads == 0
            and dim <= MAX_DIM)


def load():
    """The compiled kernel's entry point, built on first call; None if it cannot be."""
    global _kernel, _tried
    if _tried:  # decided: no lock on the hot path (every decode layer asks)
        return _kernel
    with _lock:
        if not _tried:
            if os.environ.get("SPANSERVE_CPU_KERNELS", "1") == "0":
                log.info("SPANSERVE_CPU_KERNELS=0: decode attention takes the torch path")
            else:
                try:
                    path = build()
                    _kernel = _entry_point(ctypes.CDLL(str(path)))
                    log.info("decode attention: the C kernel %s", path)
                except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
                    log.warning("the C decode kernel could not be built (%s); decode attention takes the torch "
                                "path", str(exc).strip()[-500:])
            _tried = True  # after _kernel: a thread that sees it set sees the kernel too
        return _kernel


def build() -> Path:
    """Compile the kernel for this CPU unless a build of the same source and flags is cached."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc or set CC)")
    identity = " ".join([compiler, *COMPILE_FLAGS, *LINK_FLAGS, _cpu_features()])  # -march=native: per CPU
    digest = hashlib.sha256(SOURCE.read_bytes() + identity.encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_decode-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builds: the last rename wins
        built, objects = Path(tmp) / target.name, Path(tmp) / "paged_decode.o"
        for step in ([*COMPILE_FLAGS, str(SOURCE), "-o", str(objects)], [str(objects), *LINK_FLAGS, "-o", str(built)]):
            result = subprocess.run([compiler, *step], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr}")
        os.replace(built, target)
    return target


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), so that a cache directory shared by machines keeps one
    build per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _entry_point(lib: ctypes.CDLL):
    fn = lib.paged_decode
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [pointer] * 6 + [i64, i64, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return fn
