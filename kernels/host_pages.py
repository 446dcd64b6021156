"""Large CPU tensors on 2 MiB pages: the paged KV cache, read at random block by block.

A decode step reads each sequence's KV blocks wherever the block manager put
them, across a cache of hundreds of megabytes. On 4 KiB pages nearly every
block is a TLB miss, and under a hypervisor each miss walks two page tables;
2 MiB pages map the whole cache in a few hundred TLB entries. Linux gives a
process 2 MiB pages where it asks with `madvise(MADV_HUGEPAGE)` before the
pages are first touched (transparent huge pages in their `madvise` or
`always` mode, the distributions' defaults), so `zeros_on_huge_pages` asks
for them over a fresh allocation and only then writes its zeros. Where the
call is missing or refused (another OS, THP off), the tensor is the same,
on ordinary pages; the caller gets a flag saying which.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise_huge(address: int, length: int) -> bool:
    """Whether Linux took the advice to back [address, address + length) with huge pages."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(address, length, _MADV_HUGEPAGE) == 0


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed contiguous CPU tensor of `shape`, and whether its pages were asked for as huge pages.

    Tensors under one huge page are allocated as usual. The others sit in a buffer one page larger, at its
    first 2 MiB boundary (the advice applies to whole pages), and are advised before the zeros touch them.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype), False
    span = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    raw = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    is_huge = _madvise_huge(raw.data_ptr() + offset, span)
    # The view keeps `raw`'s storage alive; the zeros fault its pages in, huge where the advice was taken.
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    tensor.zero_()
    return tensor, is_huge
