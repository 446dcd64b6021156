"""Programmatic dependent launch (Hopper GPUs and later): a kernel starts while the kernel before it ends.

A kernel launched with `launch_pdl=True` may start once every program of the kernel before it has called
`gdc_launch_dependents`, or ended, rather than once that kernel has ended and its writes are flushed: its
programs are placed on the multiprocessors and set up while the other kernel's last programs run. It must
call `gdc_wait` before it reads anything an earlier kernel wrote or writes anything an earlier kernel reads.
The matmul kernel may be launched so (a `dependent` plan, timed against the others at start-up), and the
kernels before a decode step's products (the fused norm, the attention, its splits' combine) call
`gdc_launch_dependents` as they start.

Both instructions do nothing in a kernel launched the ordinary way, and a dependent kernel waits before it
touches any data, so the results are the stream order's. A CUDA graph records the launches with their
programmatic edges.
"""

from __future__ import annotations

import torch

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without the grid-dependency instructions: no kernel takes part
    gdc_launch_dependents = gdc_wait = None


def launches_dependents(device: torch.device) -> bool:
    """Whether kernels on `device` can launch their dependents early: a CUDA GPU of compute capability 9.0 or
    later, and a Triton that has the instructions. (Off CUDA the kernels run in the interpreter, which has
    neither.)"""
    return (gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))
