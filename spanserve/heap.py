"""Keep freed memory in the process (glibc), as the engine reallocates its activations every step.

By default glibc maps each allocation above a dynamic threshold (128 KB to 32 MB) to fresh pages
and unmaps it on free, and trims the heap top back to the OS: so a step's tensors can cost a
page fault and a zeroed page per 4 KB, every step again. Serving large blocks from the heap and
never trimming it removes that; the price is that memory the engine frees stays with the
process (tcmalloc, which vLLM recommends on CPU, behaves the same). Allocations above 32 MB,
glibc's limit, still map pages."""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's maximum on 64-bit
_done = False
_libc = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc once per process; False where it is not glibc (nothing changes)."""
    global _done
    if _done:
        return True
    try:
        libc = _c()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        log.warning("mallopt refused the heap settings; large tensors keep mapping fresh pages")
    _done = ok
    return ok


def give_back() -> None:
    """Return the heap's free memory to the OS now (glibc's malloc_trim): after a large request
    body, which the settings above would otherwise keep for the process's life. Milliseconds."""
    try:
        _c().malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return _libc
