"""Programmatic dependent launch (Hopper GPUs and later): a kernel starts while the kernel before it ends.

A kernel launched with `launch_pdl=True` may start once every program of the kernel before it has called
`gdc_launch_dependents`, or ended, rather than once that kernel has ended and its writes are flushed. It must
call `gdc_wait` before it reads anything an earlier kernel wrote or writes anything an earlier kernel reads;
before the wait it may only do what depends on no earlier kernel. A decode step's matrix products are such
kernels: their weights are read-only, so the matmul kernel asks the L2 cache for its weight rows
(`prefetch_l2`), then waits, and the weight's first bytes are on their way while the normalization or the
attention before it finishes. The kernels before a product call `gdc_launch_dependents` as they start.

Both instructions do nothing in a kernel launched the ordinary way, and every kernel that takes part waits
before it touches an earlier kernel's data, so the order of results is the stream's order. A CUDA graph
records the launches with their programmatic edges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without the grid-dependency instructions: no kernel takes part
    gdc_launch_dependents = gdc_wait = None

# The bulk prefetch takes addresses and sizes in whole 16-byte units.
PREFETCH_ALIGNMENT = 16


def launches_dependents(device: torch.device) -> bool:
    """Whether kernels on `device` can launch their dependents early: a CUDA GPU of compute capability 9.0 or
    later, and a Triton that has the instructions. (Off CUDA the kernels run in the interpreter, which has
    neither.)"""
    return (gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Ask the L2 cache for `nbytes` bytes from each address of `ptrs` (16-byte aligned; `nbytes` a tensor of
    the same shape, multiples of 16): the bulk copy engine's prefetch, which fills no register and is waited
    for by nothing (Hopper and later)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs.to(tl.int64), nbytes], dtype=tl.int32, is_pure=False, pack=1)
