"""How a candidate launch of a matrix product is timed and checked, as `matmul_choice` chooses between them.

A candidate runs over every layer's matrix of one kind in turn, as a decode step reads them (more bytes than
the L2 cache holds), recorded once as a CUDA graph and replayed, so that what is timed is the product, not a
launch from Python. Before it is timed, a plan's result on the model's own weight is checked against the
fp32 reference; a plan that this GPU cannot compile or run is left out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from triton.compiler.errors import CompilationError
from triton.runtime.errors import TritonError

from kernels.decode_matmul import (
    MatmulPlan,
    can_use_tma,
    candidate_plans,
    decode_matmul,
    decode_matmul_reference,
)
from kernels.dependent_launch import launches_dependents
from kernels.norm_act import silu_and_mul

log = logging.getLogger(__name__)

# Replays of a candidate's graph timed together.
REPLAYS = 8
# How many of the fastest launches are timed again reading the weight through a tensor descriptor.
TMA_TRIES = 3
# The most bytes of fp32 weight the reference widens at once.
REFERENCE_BYTES = 256 << 20
# A plan's result against the fp32 reference, relative to the largest output: fp32 sums in another order and
# one rounding to the model's dtype on either side.
_TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}

Matrix = tuple[torch.Tensor, torch.Tensor | None]
"""A weight `[out, in]` and its per-row scales (None: in the model's dtype)."""
Timer = Callable[[Callable[[], object]], float]
"""Milliseconds one call of the given function takes on the device."""
# What a plan that this GPU cannot run raises: Triton's compile errors (ptxas's among them) and its
# shared-memory check (`TritonError`s), a launch the wrapper or a tensor descriptor refuses (its block shape,
# say), memory the plan's workspace cannot get.
_UNFIT: tuple[type[BaseException], ...] = (CompilationError, TritonError, AssertionError, ValueError, TypeError,
                                           torch.OutOfMemoryError)
_UNFIT_OR_RUNTIME: tuple[type[BaseException], ...] = (*_UNFIT, RuntimeError)


def cuda_graph_ms(fn: Callable[[], object]) -> float:
    """`fn` recorded once as a CUDA graph and replayed REPLAYS times: milliseconds per replay (its first call,
    which compiles and allocates, runs outside the recording)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # The caller's stream comes back even where ending a failed recording raises.
    with torch.cuda.stream(torch.cuda.current_stream()), torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPLAYS


def each_product(x: torch.Tensor, matrices: Sequence[Matrix], plan: MatmulPlan | None,
                 gated: bool = False) -> list[torch.Tensor]:
    """`x` by each matrix in turn, with the plan or (None) torch's product; `gated`: `silu_and_mul(x)` by each,
    read in by the plan's kernel."""
    return [F.linear(x, w) if plan is None else decode_matmul(x, w, s, plan, gated) for w, s in matrices]


def each_activation_then_product(x: torch.Tensor, matrices: Sequence[Matrix],
                                 plan: MatmulPlan | None) -> list[torch.Tensor]:
    """As an MLP's layers do without the gated kernel: the activation's own kernel, then the product by the plan
    or (None) torch's product, for each matrix in turn."""
    return [F.linear(silu_and_mul(x), w) if plan is None else decode_matmul(silu_and_mul(x), w, s, plan)
            for w, s in matrices]


def reference(x: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    """`decode_matmul_reference` in fp32, a slice of the weight's rows at a time: an lm_head in fp32 whole would
    take gigabytes."""
    weight, scales = matrix
    rows = max(1, REFERENCE_BYTES // (4 * weight.shape[1]))
    return torch.cat([decode_matmul_reference(x.float(), weight[i:i + rows],
                                              None if scales is None else scales[i:i + rows])
                      for i in range(0, weight.shape[0], rows)], dim=1).to(x.dtype).float()


def _matches(x: torch.Tensor, matrix: Matrix, plan: MatmulPlan, want: torch.Tensor, gated: bool = False) -> bool:
    weight, scales = matrix
    got = decode_matmul(x, weight, scales, plan, gated).float()
    limit = _TOLERANCE[x.dtype] * (float(want.abs().max()) or 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= limit


def time_plans(x: torch.Tensor, matrices: Sequence[Matrix], plans: Sequence[MatmulPlan], want: torch.Tensor,
                timer: Timer, gated: bool = False) -> list[tuple[float, MatmulPlan]]:
    """Each plan's time over `matrices`, once its result matched `want`; plans that differ, or that this GPU
    cannot run, left out (and logged)."""
    n, k = matrices[0][0].shape
    storage = matrices[0][0].dtype
    timed = []
    for plan in plans:
        try:
            if not _matches(x, matrices[0], plan, want, gated):
                log.warning("matmul plan %s for [%d, %d] %s differs from the reference: left out", plan.describe(),
                            n, k, storage)
                continue
            timed.append((timer(partial(each_product, x, matrices, plan, gated)), plan))
        except _UNFIT_OR_RUNTIME as error:
            if not isinstance(error, _UNFIT) and x.device.type == "cuda":
                # Triton's backend passes fail with a plain RuntimeError; so does a faulted device, whose next
                # synchronization raises too, ending the timing.
                torch.cuda.synchronize(x.device)
            log.info("matmul plan %s for [%d, %d] %s cannot run here (%s: %s): left out", plan.describe(), n, k,
                     storage, type(error).__name__, error)
    return timed


def time_launches(matrices: Sequence[Matrix], bucket: int, dtype: torch.dtype, device: torch.device,
                  generator: torch.Generator, num_multiprocessors: int, timer: Timer = cuda_graph_ms,
                  with_tma: bool = False) -> tuple[float | None, list[tuple[float, MatmulPlan]]]:
    """`bucket` rows by `matrices`: torch's product's time (None for a quantized weight, which torch does not
    take), and each candidate plan's that gave the reference's result and runs here, in `candidate_plans`'
    order, then the fastest TMA_TRIES again through a tensor descriptor where `with_tma`, then the fastest
    TMA_TRIES of all those again as dependent launches where the GPU has them."""
    n, k = matrices[0][0].shape
    storage = matrices[0][0].dtype
    x = torch.randn((bucket, k), generator=generator, device=device).to(dtype)
    want = reference(x, matrices[0])
    torch_ms = None if storage != dtype else timer(partial(each_product, x, matrices, None))
    timed = time_plans(x, matrices, candidate_plans(bucket, n, k, num_multiprocessors, storage.itemsize), want,
                        timer)
    if with_tma and can_use_tma(k, storage.itemsize):
        # Through the tensor memory accelerator: the fastest few launches again, not every one (each is
        # another compiled variant of the kernel).
        fastest = sorted(timed, key=lambda item: item[0])[:TMA_TRIES]
        timed += time_plans(x, matrices, [dataclasses.replace(plan, tma=True) for _, plan in fastest], want, timer)
    if launches_dependents(device):
        # Started while the product before it ends: the fastest few again, as with the tensor descriptor.
        fastest = sorted(timed, key=lambda item: item[0])[:TMA_TRIES]
        timed += time_plans(x, matrices, [dataclasses.replace(plan, dependent=True) for _, plan in fastest], want,
                            timer)
    return torch_ms, timed
