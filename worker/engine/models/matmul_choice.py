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
another bucket eager than padded, as torch's own products may take another algorithm by row count.) Without a
timed choice (tuning off, or a shape not timed) a quantized weight takes the default plan of its bucket and a
plain one torch's product.

The choices are kept in a file per GPU model, torch and Triton version, activation dtype and version of the
kernel's source (`cache_file`), so that a worker restarted on the same machine, or a second worker beside it,
takes the same launches without timing them again: the same greedy tokens after a restart, and a start-up
that times only matrix kinds it has not met. Among plans within `MIN_GAIN` of the fastest the first in
`candidate_plans`' order is kept, so that timing noise rarely changes a choice either.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import TritonError

import kernels.decode_matmul
from kernels.decode_matmul import (
    MAX_ROWS,
    MatmulPlan,
    can_use_tma,
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
# How many of the fastest launches are timed again reading the weight through a tensor descriptor.
TMA_TRIES = 3
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
# shared-memory check (`TritonError`s), a launch the wrapper or a tensor descriptor refuses (its block shape,
# say), memory the plan's workspace cannot get.
_UNFIT: tuple[type[BaseException], ...] = (CompilationError, TritonError, AssertionError, ValueError, TypeError,
                                           torch.OutOfMemoryError)


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


def cache_file(directory: Path, device: torch.device, dtype: torch.dtype, num_multiprocessors: int) -> Path:
    """Where the choices for this GPU model, torch and Triton, activation dtype and kernel source are kept."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    source = Path(kernels.decode_matmul.__file__).read_bytes()
    tag = hashlib.sha256(repr((name, num_multiprocessors, torch.__version__, triton.__version__, str(dtype))).encode()
                         + source).hexdigest()[:16]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return directory / f"{slug}-{str(dtype).removeprefix('torch.')}-{tag}.json"


_PLAN_FIELDS = ("block_m", "block_n", "block_k", "split_k", "k_per_split", "num_warps", "num_stages", "tma")
_PLAN_INTS = _PLAN_FIELDS[:-1]


def _entry_key(bucket: int, kind: MatrixKind) -> str:
    return f"{kind[0]}x{kind[1]}:{str(kind[2]).removeprefix('torch.')}:{bucket}"


def _read_cache(path: Path) -> dict[str, MatmulPlan | None]:
    """The choices kept in `path`, by `_entry_key`; none where it is missing, and none (with a warning) where it
    cannot be read or holds anything but well-formed plans."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as error:
        log.warning("cannot read the matmul choices in %s (%s): timing them again", path, error)
        return {}
    try:
        entries = json.loads(text)
        if not isinstance(entries, dict):
            raise ValueError("not an object")
        return {key: None if value is None else _plan_from(value) for key, value in entries.items()}
    except (ValueError, TypeError) as error:
        log.warning("the matmul choices in %s are not readable (%s): timing them again", path, error)
        return {}


def _plan_from(value: Any) -> MatmulPlan:
    if not isinstance(value, dict) or set(value) != set(_PLAN_FIELDS):
        raise ValueError(f"a plan has the fields {', '.join(_PLAN_FIELDS)}, got {value!r}")
    if not all(type(value[name]) is int and value[name] > 0 for name in _PLAN_INTS) or type(value["tma"]) is not bool:
        raise ValueError(f"a plan's fields are positive integers and a true/false tma, got {value!r}")
    return MatmulPlan(**value)


def _fits(plan: MatmulPlan | None, bucket: int, k: int, weight_bytes: int, with_tma: bool) -> bool:
    """Whether `plan` (None: torch's product) can launch `bucket` rows by a matrix `k` long, of `weight_bytes` an
    element, on this GPU (`with_tma`: it has the tensor memory accelerator)."""
    if plan is None:
        return True
    if plan.tma and not (with_tma and can_use_tma(k, weight_bytes)):
        return False
    # tl.dot takes blocks of powers of two, 16 or more.
    blocks = (plan.block_m, plan.block_n, plan.block_k)
    return (all(b >= 16 and b & (b - 1) == 0 for b in blocks) and plan.block_m >= bucket
            and plan.k_per_split % plan.block_k == 0 and plan.split_k * plan.k_per_split >= k)


def _write_cache(path: Path, entries: Mapping[str, MatmulPlan | None]) -> None:
    """`entries` into `path`, whole or not at all (a second worker may be reading it); a failure is logged."""
    payload = {key: None if plan is None else {name: getattr(plan, name) for name in _PLAN_FIELDS}
               for key, plan in sorted(entries.items())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError as error:
        log.warning("cannot keep the matmul choices in %s (%s): the next start times them again", path, error)
        return
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(payload, out, indent=1)
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        log.warning("cannot keep the matmul choices in %s (%s): the next start times them again", path, error)


def choose_matmuls(groups: Mapping[MatrixKind, Sequence[Matrix]], dtype: torch.dtype, device: torch.device,
                   num_multiprocessors: int, timer: Timer = cuda_graph_ms,
                   buckets: Sequence[int] = ROW_BUCKETS, cache: Path | None = None,
                   with_tma: bool | None = None) -> MatmulChoices:
    """For each kind of matrix (its matrices, every layer's, in `groups`) and each bucket, the fastest of the
    candidate plans and, for weights in `dtype`, torch's product, by `timer` over the whole group; choices
    already in the `cache` file are taken from it, and new ones added to it. A plan that does not compile or
    fit this GPU, or whose result differs from the reference, is left out (and logged); a quantized kind left
    with no plan widens its weight for torch's product. Any other failure (of the device, say) ends the
    timing and propagates. `with_tma`: time launches that read the weight through a tensor descriptor too
    (default: on a CUDA GPU of compute capability 9.0 or later, which copies them with its tensor memory
    accelerator)."""
    if with_tma is None:
        with_tma = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    started = time.perf_counter()
    kept = _read_cache(cache) if cache is not None else {}
    plans: dict[tuple[int, MatrixKind], MatmulPlan | None] = {}
    generator = torch.Generator(device=device).manual_seed(0)
    num_timed = 0
    try:
        for kind, matrices in groups.items():
            n, k, storage = kind
            quantized = storage != dtype
            for bucket in buckets:
                key = _entry_key(bucket, kind)
                if key in kept and _fits(kept[key], bucket, k, storage.itemsize, with_tma):
                    plans[(bucket, kind)] = kept[key]
                    continue
                if key in kept:
                    log.warning("the kept matmul choice %s does not fit %s: timing it again", kept[key], key)
                num_timed += 1
                plans[(bucket, kind)] = _fastest(matrices, bucket, quantized, dtype, device, generator,
                                                 num_multiprocessors, timer, with_tma)
    finally:
        if device.type == "cuda":
            # The recordings' and references' memory back to the device: the KV cache is sized from what the
            # device has free.
            torch.cuda.empty_cache()
    if cache is not None and num_timed:
        _write_cache(cache, {**kept, **{_entry_key(bucket, kind): plan for (bucket, kind), plan in plans.items()}})
    choices = MatmulChoices(num_multiprocessors, plans)
    log.info("matrix products: %d choices timed in %.1f s, %d kept from %s; carpool's kernel serves:\n  %s",
             num_timed, time.perf_counter() - started, len(plans) - num_timed, cache or "no file",
             "\n  ".join(choices.describe()))
    return choices


def _fastest(matrices: Sequence[Matrix], bucket: int, quantized: bool, dtype: torch.dtype, device: torch.device,
             generator: torch.Generator, num_multiprocessors: int, timer: Timer,
             with_tma: bool) -> MatmulPlan | None:
    """The launch for `bucket` rows by `matrices`: the first candidate plan within MIN_GAIN of the fastest, or
    None (torch's product) where that is the faster, for a plain weight, or where no plan works."""
    n, k = matrices[0][0].shape
    storage = matrices[0][0].dtype
    x = torch.randn((bucket, k), generator=generator, device=device).to(dtype)
    want = _reference(x, matrices[0])
    torch_ms = None if quantized else timer(partial(each_product, x, matrices, None))
    timed: list[tuple[float, MatmulPlan]] = []

    def time_plans(plans: Sequence[MatmulPlan]) -> None:
        for plan in plans:
            try:
                if not _matches(x, matrices[0], plan, want):
                    log.warning("matmul plan %s for [%d, %d] %s differs from the reference: left out",
                                plan.describe(), n, k, storage)
                    continue
                timed.append((timer(partial(each_product, x, matrices, plan)), plan))
            except _UNFIT as error:
                log.info("matmul plan %s for [%d, %d] %s cannot run here (%s: %s): left out", plan.describe(), n,
                         k, storage, type(error).__name__, error)

    time_plans(candidate_plans(bucket, n, k, num_multiprocessors, storage.itemsize))
    if with_tma and can_use_tma(k, storage.itemsize):
        # Through the tensor memory accelerator: the fastest few launches again, not every one (each is
        # another compiled variant of the kernel).
        fastest = sorted(timed, key=lambda item: item[0])[:TMA_TRIES]
        time_plans([dataclasses.replace(plan, tma=True) for _, plan in fastest])
    if not timed:
        return None
    best_ms = min(ms for ms, _ in timed)
    first_ms, first = next((ms, plan) for ms, plan in timed if ms <= (1 + MIN_GAIN) * best_ms)
    if torch_ms is not None and first_ms > (1 - MIN_GAIN) * torch_ms:
        return None
    return first
