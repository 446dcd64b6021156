"""Torch's intra-op thread count, set once per process at its edge (`carpool worker`, `carpool generate`).

Torch sizes its intra-op pool to the machine's cores. On a CPU that other
processes share, a small model's ops are too short to split, and the pool's
threads spin waiting for cores that are busy: one `generate` of 16 prompts
with the built-in model took 0.55-0.8 s on one thread and 0.55-88 s on two,
on a 2-core machine with other work running. So CPU workers default to one
thread; CUDA workers keep torch's default (the CPU only feeds the GPU).
"""

from __future__ import annotations

CPU_DEFAULT_TORCH_THREADS = 1


def torch_threads_for(threads: int, device: str) -> int | None:
    """The thread count to set for `threads` (0 = automatic) on `device`; None leaves torch's default."""
    assert threads >= 0
    if threads > 0:
        return threads
    return CPU_DEFAULT_TORCH_THREADS if device == "cpu" else None


def apply_torch_threads(threads: int, device: str) -> int:
    """Set torch's intra-op threads for this process; returns the count in effect."""
    import torch

    wanted = torch_threads_for(threads, device)
    if wanted is not None:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()
