"""The CPU KV cache on huge pages: zeroed, aligned, the same layout as before, and (where Linux offers
transparent huge pages) advised to be backed by them. Whether the kernel grants a huge page at a given moment
depends on its free memory's fragmentation, so the tests check the advice (the mapping's `hg` flag), which is
the cache's doing, not the grant, which is the kernel's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from kernels.host_pages import HUGE_PAGE_BYTES, zeros_on_huge_pages
from kernels.paged_attention_torch import new_kv_cache

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    """Linux with transparent huge pages in `always` or `madvise` mode (the bracketed word of the file)."""
    try:
        mode = re.search(r"\[(\w+)\]", _THP_MODE.read_text())
    except OSError:
        return False
    return mode is not None and mode.group(1) in ("always", "madvise")


def _is_advised_huge(address: int, nbytes: int) -> bool:
    """Whether every mapping over [address, address + nbytes) carries `madvise(MADV_HUGEPAGE)`'s `hg` flag in
    /proc/self/smaps."""
    flags: list[bool] = []
    overlaps = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span is not None:
            start, end = int(span.group(1), 16), int(span.group(2), 16)
            overlaps = start < address + nbytes and address < end
        elif overlaps and line.startswith("VmFlags:"):
            flags.append("hg" in line.split()[1:])
    return bool(flags) and all(flags)


def test_a_large_tensor_is_zeroed_aligned_and_advised() -> None:
    shape = (3, 1000, 16, 32)  # 6 MB of fp32: not a whole number of huge pages
    tensor, is_huge = zeros_on_huge_pages(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert not tensor.any()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert is_huge == sys.platform.startswith("linux")
    tensor[-1, -1, -1, -1] = 1.0  # the last element is the tensor's own, writable
    assert float(tensor.sum()) == 1.0
    if _thp_offered():
        assert _is_advised_huge(tensor.data_ptr(), tensor.nbytes)


def test_a_small_tensor_is_a_plain_allocation() -> None:
    tensor, is_huge = zeros_on_huge_pages((4, 8), torch.bfloat16)
    assert not is_huge
    assert tensor.shape == (4, 8) and tensor.dtype == torch.bfloat16 and not tensor.any()


def test_the_cpu_kv_cache_keeps_its_head_major_layout() -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 2048, 16, 4, 32
    cache = new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    assert cache.shape == (num_blocks, block_size, num_kv_heads, head_dim)
    assert cache.permute(2, 0, 1, 3).is_contiguous()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not cache.any()
