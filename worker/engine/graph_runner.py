"""Decode steps recorded once per padded batch size, then replayed.

A decode step's forward launches hundreds of small kernels; recorded as a
CUDA graph it replays in one launch. A graph freezes everything the host
decided when it was recorded — shapes, launch grids, host integers — so the
forward it records must read every changing value from the persistent
device buffers (`worker.engine.step_inputs`) and nothing back to the host.

A set of graphs (`DecodeGraphs`) has one query length `q`: every sequence
of a step it replays brings exactly `q` token rows. Decode graphs have
`q = 1`; with speculative decoding the runner also records verify graphs,
`q = 1 + num_speculative_tokens`, for steps in which sequences bring
proposed tokens to verify (a sequence with fewer is padded up to `q`).
Graphs exist for batch sizes 1, 2, 4, 8 and then every 8 up to
`max_num_seqs`; a step of `n` sequences replays the smallest graph of at
least `n` sequences, its extra rows padded to write nowhere. They are
recorded largest first into one memory pool, after a warm-up run of each.

Two capture backends: `CudaGraphCapture`, and `ReplayCapture`, which runs
the forward again at every replay under `forbid_host_reads`: on a CPU it
tests the padding, the size choice and that a replayed step reads its
inputs only from the buffers, which is what a CUDA graph needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

Forward = Callable[[int, int], torch.Tensor]
"""`forward(n, q)` runs the step over the first `n` sequences of the step buffers, `q` token rows each, and
returns its logits."""

# Tensor calls that read a device value back to the host (or make the host wait for one).
HOST_READS = frozenset({
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "masked_select", "unique",
})
# RoPE types whose module branches on the positions' values on the host.
HOST_BRANCHING_ROPE = frozenset({"dynamic", "longrope"})


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_num_seqs` (which is always one of them)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs]
    sizes += range(16, max_num_seqs, 8)
    return sorted({*sizes, max_num_seqs})


class HostReadError(RuntimeError):
    """A step meant to be replayed read a device value on the host."""


class _ForbidHostReads(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not _called_by_triton_interpreter():
            raise HostReadError(f"a recorded step called Tensor.{name}, which reads a device value on the host")
        return func(*args, **(kwargs or {}))


def _called_by_triton_interpreter() -> bool:
    """Triton's CPU interpreter copies tensors to numpy to run a kernel: that is the kernel, not the host."""
    frame = sys._getframe(2)
    while frame is not None:
        if "triton" in frame.f_code.co_filename and "interpreter" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextmanager
def forbid_host_reads() -> Iterator[None]:
    """Raise `HostReadError` on any call that reads a tensor's value on the host inside this block."""
    with _ForbidHostReads():
        yield


class CaptureBackend(Protocol):
    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record `run` once; the returned replay runs it again and returns its output."""
        ...


class CudaGraphCapture:
    """CUDA graphs sharing one memory pool."""

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        self._graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class ReplayCapture:
    """Runs the step again at every replay, forbidding host reads, with the arguments it was recorded with."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        with forbid_host_reads():
            run()

        def replay() -> torch.Tensor:
            with forbid_host_reads():
                return run()

        return replay


class DecodeGraphs:
    """One recorded step per padded batch size, every sequence bringing `query_len` token rows."""

    def __init__(self, forward: Forward, sizes: list[int], backend: CaptureBackend, query_len: int = 1) -> None:
        assert sizes and all(n > 0 for n in sizes) and query_len > 0, (sizes, query_len)
        self.sizes = sorted(sizes)
        self.query_len = query_len
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        for n in reversed(self.sizes):
            forward(n, query_len)  # warm-up: kernels compiled and workspaces grown outside the recording
            self._replays[n] = backend.capture(lambda n=n: forward(n, query_len))  # type: ignore[misc]

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest recorded size that holds `num_seqs` sequences, or None when none does."""
        for n in self.sizes:
            if n >= num_seqs:
                return n
        return None

    def replay(self, padded: int) -> torch.Tensor:
        """The logits the recorded forward returns for `padded` sequences, padding's rows included."""
        return self._replays[padded]()


def rope_type(config: Any) -> str:
    """The model's RoPE variant, as transformers names it ("default" when none is set)."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            kind = value.get("rope_type") or value.get("type")
            if kind:
                return str(kind)
    return "default"
