"""keep_freed_memory: large tensors come from the process's heap instead of fresh mapped pages."""

import subprocess
import sys

import pytest

# In a fresh process: the bytes glibc maps (mmap) for a new 16 MB tensor, from mallinfo2.
_MAPPED_FOR_A_TENSOR = """
import ctypes, sys, torch
from spanserve.heap import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
tensor = torch.ones(16 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _MAPPED_FOR_A_TENSOR, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_a_large_tensor_comes_from_the_heap_not_fresh_pages():
    assert _mapped_bytes("default") >= 16 << 20  # glibc's default: fresh pages, unmapped on free
    assert _mapped_bytes("keep") == 0
