"""Which product serves each of a model's matrices at decode-sized row counts, chosen by timing them on the GPU.

With a few rows a product costs what reading its weight costs, and how close it comes to the memory's bandwidth
depends on how its launch spreads the weight over the multiprocessors: no one launch is best for every shape,
and torch's own product (cuBLAS) is not always the best either. So at start-up on CUDA, for each kind of
matrix (an `(out, in)` shape and storage type: qkv, o, gate_up, down, lm_head) and each row bucket up to
`MAX_ROWS`, the candidate plans of `kernels.decode_matmul` and, for weights in the model's dtype, torch's
product are timed, and the fastest is kept. Each candidate is timed as a step reads the weights: over every
layer's matrix of that kind, one after another (more bytes than the L2 cache holds), recorded once as a CUDA
graph and replayed. Torch's product keeps its place unless a plan beats it by `MIN_GAIN`, and a plan is kept
only once its result on the model's own weight matched torch's.

A product of `rows` rows takes the choice of the smallest bucket that holds them, so a decode step replayed at
a padded batch size and the same step run eager take the same launch: a row's result depends on the plan, never
on how many rows share it. (A speculative verify step's rows, sequences times proposed tokens, may fall in
another bucket eager than padded, as torch's own products may take another algorithm by row count.) Without a timed choice (tuning off, or a shape not timed) a quantized weight takes
the default plan of its bucket and a plain one torch's product.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from triton.compiler.errors import CompilationError
from triton.runtime.errors import TritonError

from kernels.decode_matmul import (
    MAX_ROWS,
    MatmulPlan,
    candidate_plans,
    decode_matmul,
    decode_matmul_reference,
    plan_decode_matmul,
)

log = logging.getLogger(__name__)

# The row counts choices are made for; graph batch sizes (1, 2, 4, 8, then every 8) fall on them.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, MAX_ROWS)
# How much faster than torch's product a plan must be to replace it: timing noise is a few per cent.
MIN_GAIN = 0.03
# Replays of a candidate's graph timed together.
REPLAYS = 8
# The most bytes of fp32 weight the reference widens at once.
REFERENCE_BYTES = 256 << 20
# A plan's result against the fp32 reference, relative to the largest output: fp32 sums in another order and
# one rounding to the model's dtype on either side.
_TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}

MatrixKind = tuple[int, int, torch.dtype]
"""A matrix's `(out, in)` shape and storage dtype."""
Matrix = tuple[torch.Tensor, torch.Tensor | None]
"""A weight `[out, in]` and its per-row scales (None: in the model's dtype)."""
Timer = Callable[[Callable[[], object]], float]
"""Milliseconds one call of the given function takes on the device."""
# What a plan that this GPU cannot run raises: Triton's compile errors (ptxas's among them) and its
# shared-memory check (`TritonError`s), a launch
# the wrapper refuses, memory the plan's workspace cannot get.
_UNFIT: tuple[type[BaseException], ...] = (CompilationError, TritonError, AssertionError, torch.OutOfMemoryError)


def row_bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (1 <= rows <= MAX_ROWS)."""
    return ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, rows)]


def kind_of(weight: torch.Tensor) -> MatrixKind:
    return weight.shape[0], weight.shape[1], weight.dtype


@dataclass(frozen=True)
class MatmulChoices:
    """The launch for each product of at most MAX_ROWS rows by a model's matrices."""

    num_multiprocessors: int
    plans: Mapping[tuple[int, MatrixKind], MatmulPlan | None] = field(default_factory=dict)
    """By (row bucket, matrix kind): the kernel's plan, or None for torch's product."""

    def plan(self, rows: int, weight: torch.Tensor, quantized: bool) -> MatmulPlan | None:
        """The kernel's plan for `rows` rows by `weight` (a quantized weight's data), or None for torch's product
        (more rows than the kernel takes, or torch's was the faster)."""
        if not 0 < rows <= MAX_ROWS:
            return None
        bucket = row_bucket(rows)
        key = (bucket, kind_of(weight))
        if key in self.plans:
            return self.plans[key]
        if not quantized:
            return None
        return plan_decode_matmul(bucket, weight.shape[0], weight.shape[1], self.num_multiprocessors)

    def describe(self) -> list[str]:
        """One line per matrix kind: the buckets the kernel took, and with which plans."""
        lines = []
        for kind in sorted({kind for _, kind in self.plans}, key=str):
            taken = [f"{bucket} rows: {plan.describe()}" for (bucket, k), plan in sorted(
                self.plans.items(), key=lambda item: item[0][0]) if k == kind and plan is not None]
            name = f"[{kind[0]}, {kind[1]}] {str(kind[2]).removeprefix('torch.')}"
            lines.append(f"{name}: " + ("; ".join(taken) if taken else "torch's product at every bucket"))
        return lines


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


def each_product(x: torch.Tensor, matrices: Sequence[Matrix], plan: MatmulPlan | None) -> list[torch.Tensor]:
    """`x` by each matrix in turn, with the plan or (None) torch's product."""
    return [F.linear(x, w) if plan is None else decode_matmul(x, w, s, plan) for w, s in matrices]


def _reference(x: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    """`decode_matmul_reference` in fp32, a slice of the weight's rows at a time: an lm_head in fp32 whole would
    take gigabytes."""
    weight, scales = matrix
    rows = max(1, REFERENCE_BYTES // (4 * weight.shape[1]))
    return torch.cat([decode_matmul_reference(x.float(), weight[i:i + rows],
                                              None if scales is None else scales[i:i + rows])
                      for i in range(0, weight.shape[0], rows)], dim=1).to(x.dtype).float()


def _matches(x: torch.Tensor, matrix: Matrix, plan: MatmulPlan, want: torch.Tensor) -> bool:
    weight, scales = matrix
    got = decode_matmul(x, weight, scales, plan).float()
    limit = _TOLERANCE[x.dtype] * (float(want.abs().max()) or 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= limit


def choose_matmuls(groups: Mapping[MatrixKind, Sequence[Matrix]], dtype: torch.dtype, device: torch.device,
                   num_multiprocessors: int, timer: Timer = cuda_graph_ms,
                   buckets: Sequence[int] = ROW_BUCKETS) -> MatmulChoices:
    """For each kind of matrix (its matrices, every layer's, in `groups`) and each bucket, the fastest of the
    candidate plans and, for weights in `dtype`, torch's product, by `timer` over the whole group. A plan that
    does not compile or fit this GPU, or whose result differs from the reference, is left out (and logged); a
    quantized kind left with no plan widens its weight for torch's product. Any other failure (of the device,
    say) ends the timing and propagates."""
    started = time.perf_counter()
    plans: dict[tuple[int, MatrixKind], MatmulPlan | None] = {}
    generator = torch.Generator(device=device).manual_seed(0)
    try:
        for kind, matrices in groups.items():
            n, k, storage = kind
            quantized = storage != dtype
            for bucket in buckets:
                x = torch.randn((bucket, k), generator=generator, device=device).to(dtype)
                want = _reference(x, matrices[0])
                timed: list[tuple[float, MatmulPlan | None]] = []
                if not quantized:
                    timed.append((timer(partial(each_product, x, matrices, None)), None))
                for plan in candidate_plans(bucket, n, k, num_multiprocessors, storage.itemsize):
                    try:
                        if not _matches(x, matrices[0], plan, want):
                            log.warning("matmul plan %s for [%d, %d] %s differs from the reference: left out",
                                        plan.describe(), n, k, storage)
                            continue
                        ms = timer(partial(each_product, x, matrices, plan))
                    except _UNFIT as error:
                        log.info("matmul plan %s for [%d, %d] %s cannot run here (%s: %s): left out",
                                 plan.describe(), n, k, storage, type(error).__name__, error)
                        continue
                    timed.append((ms, plan))
                best_ms, best = min(timed, key=lambda item: item[0]) if timed else (0.0, None)
                if not quantized and best is not None and best_ms > (1 - MIN_GAIN) * timed[0][0]:
                    best = None
                plans[(bucket, kind)] = best
    finally:
        if device.type == "cuda":
            # The recordings' and references' memory back to the device: the KV cache is sized from what the
            # device has free.
            torch.cuda.empty_cache()
    choices = MatmulChoices(num_multiprocessors, plans)
    log.info("matrix products timed at %d row counts in %.1f s; carpool's kernel serves:\n  %s", len(buckets),
             time.perf_counter() - started, "\n  ".join(choices.describe()))
    return choices
