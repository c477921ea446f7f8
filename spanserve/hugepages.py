"""A model's CPU weights on 2 MB pages where Linux gives them (transparent huge pages in
"madvise" mode, the common default).

Each forward pass streams every weight once, and on 4 KB pages that walks far more pages than
the TLB holds. Asking for huge pages (madvise(MADV_HUGEPAGE) before the memory is first touched)
made SmolLM2's w8a8 projections 0.92-0.95x their time at 1, 8 and 26 rows, and a sparse session
question at 7.6k tokens 0.86-0.95x (one-off A/Bs in one process, session 35). Most of a small
model's weights are separate tensors under 2 MB, which cannot fill a huge page alone: they are
gathered into large allocations. The KV cache stays on ordinary pages: on huge pages, dense
questions over it were no faster, at times slower, in the same A/Bs. Where huge pages are off or
the call is missing, the memory is ordinary memory.
"""

import ctypes
import ctypes.util
import logging
from itertools import chain

import torch
from torch import nn

log = logging.getLogger(__name__)

PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_ALIGN = 64  # each gathered storage starts on a cache line


def empty(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialized bytes (uint8) on the CPU, starting on a 2 MB boundary, advised to
    be backed by huge pages once touched."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    out = raw[start:start + nbytes]
    if nbytes >= PAGE:
        _advise(out.data_ptr(), nbytes // PAGE * PAGE)
    return out


def gather_weights(model: nn.Module, chunk: int = 64 << 20) -> int:
    """Move every CPU parameter and buffer of `model` onto huge pages, in place (`tensor.data` is
    swapped, so tied weights and every holder of a parameter follow): storages are copied into
    allocations of about `chunk` bytes each, so a gather needs that much memory beyond the model,
    not twice the model. Tensors that share storage (views, tied weights) keep sharing it. Returns
    the bytes moved."""
    holders: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in chain(model.parameters(), model.buffers()) if t.device.type == "cpu"}.values():
        holders.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    group, size, moved = [], 0, 0
    for tensors in holders.values():
        nbytes = -(-tensors[0].untyped_storage().nbytes() // _ALIGN) * _ALIGN
        if group and size + nbytes > chunk:
            moved += _move(group, size)
            group, size = [], 0
        group.append(tensors)
        size += nbytes
    return moved + (_move(group, size) if group else 0)


def _move(group: list[list[torch.Tensor]], size: int) -> int:
    """Each storage of `group` (its tensors) copied into one new allocation of `size` bytes."""
    arena, at = empty(size), 0
    for tensors in group:
        storage = tensors[0].untyped_storage()
        arena[at:at + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        first = arena.storage_offset() + at  # bytes, a multiple of 64
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype).set_(arena.untyped_storage(), first // t.element_size()
                                                        + t.storage_offset(), t.size(), t.stride())
        at += -(-storage.nbytes() // _ALIGN) * _ALIGN
    return size


def _advise(address: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    if madvise(address, length, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): ordinary pages", ctypes.get_errno())
        return False
    return True
