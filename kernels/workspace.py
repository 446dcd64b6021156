"""Named scratch buffers reused across layers and steps.

A fresh multi-megabyte tensor per layer is mapped anew by the allocator each
time, and on CPU touching it page-faults every 4 KiB page: at a 500-token
context that cost more than the attention itself. On CUDA, buffers a graph
records must exist before its capture: `reserve` them first. A runner owns
one workspace; it is not thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Workspace:
    _buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape` over the named buffer (grown when too small); its contents are garbage.

        `device` as a tensor on it reports it (`cuda:0`, never `cuda`): another spelling is another buffer."""
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """Grow the named buffer to hold `shape` now, so no later `take` of at most that size allocates.

        `take` is keyed by the device its callers' tensors report (`cuda` is `cuda:<current GPU>` there, and
        `cpu:0` is `cpu`), so the device is resolved as a tensor made on it reports it, or the reservation would
        serve no take.
        """
        self.take(name, shape, dtype, torch.empty(0, device=device).device)
