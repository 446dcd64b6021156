"""Which product serves each of a model's matrices at decode-sized row counts, chosen by timing them on the GPU.

With a few rows a product costs what reading its weight costs, and how close it comes to the memory's bandwidth
depends on how its launch spreads the weight over the multiprocessors: no one launch is best for every shape,
and torch's own product (cuBLAS) is not always the best either. So at start-up on CUDA, for each kind of
matrix (an `(out, in)` shape and storage type: qkv, o, gate_up, down, lm_head) and each row bucket up to
`MAX_ROWS`, the candidate plans of `kernels.decode_matmul` and, for weights in the model's dtype, torch's
product are timed, and the fastest is kept. Each candidate is timed as a step reads the weights: over every
layer's matrix of that kind, one after another (more bytes than the L2 cache holds), recorded once as a CUDA
graph and replayed (`worker.engine.models.matmul_timing`). Torch's product keeps its place unless a plan beats it by `MIN_GAIN`, and a plan is kept
only once its result on the model's own weight matched torch's. For an MLP's down projection the kernel may
also read the activation in (SiLU(gate) * up, `decode_matmul(..., gated=True)`): that is timed against the
activation's own kernel followed by the plain choice.

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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

import kernels.decode_matmul
from kernels.decode_matmul import (
    MAX_ROWS,
    MatmulPlan,
    can_use_tma,
    candidate_plans,
    plan_decode_matmul,
    silu_and_mul_rounded,
)
from kernels.dependent_launch import launches_dependents
from worker.engine.models.matmul_timing import (
    Matrix,
    Timer,
    cuda_graph_ms,
    each_activation_then_product,
    reference,
    time_launches,
    time_plans,
)

log = logging.getLogger(__name__)

# The row counts choices are made for; graph batch sizes (1, 2, 4, 8, then every 8) fall on them.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, MAX_ROWS)
# How much faster than torch's product a plan must be to replace it: timing noise is a few per cent.
MIN_GAIN = 0.03
# How many of a down projection's fastest launches are timed again reading its activation in.
GATED_TRIES = 3

MatrixKind = tuple[int, int, torch.dtype]
"""A matrix's `(out, in)` shape and storage dtype."""


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
    gated: Mapping[tuple[int, MatrixKind], MatmulPlan | None] = field(default_factory=dict)
    """For an MLP's down projection, by (row bucket, matrix kind): the plan of the kernel that reads the
    activation in (`decode_matmul(..., gated=True)`), or None for the activation's own kernel and then the
    product by `plans`."""

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

    def gated_plan(self, rows: int, weight: torch.Tensor) -> MatmulPlan | None:
        """The plan that multiplies `silu_and_mul` of `rows` rows by `weight` (a down projection's, or a quantized
        one's data) in one launch, or None: the activation's kernel first, then `plan`'s product."""
        if not 0 < rows <= MAX_ROWS:
            return None
        return self.gated.get((row_bucket(rows), kind_of(weight)))

    def describe(self) -> list[str]:
        """One line per matrix kind (and per down projection with its activation read in): the buckets the
        kernel took, and with which plans."""
        lines = []
        for label, table in (("", self.plans), (", SiLU-and-multiply read in", self.gated)):
            for kind in sorted({kind for _, kind in table}, key=str):
                taken = [f"{bucket} rows: {plan.describe()}" for (bucket, k), plan in sorted(
                    table.items(), key=lambda item: item[0][0]) if k == kind and plan is not None]
                name = f"[{kind[0]}, {kind[1]}] {str(kind[2]).removeprefix('torch.')}{label}"
                other = "torch's product" if not label else "the activation's own kernel first"
                lines.append(f"{name}: " + ("; ".join(taken) if taken else f"{other} at every bucket"))
        return lines


def cache_file(directory: Path, device: torch.device, dtype: torch.dtype, num_multiprocessors: int) -> Path:
    """Where the choices for this GPU model, torch and Triton, activation dtype and kernel source are kept."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    source = Path(kernels.decode_matmul.__file__).read_bytes()
    tag = hashlib.sha256(repr((name, num_multiprocessors, torch.__version__, triton.__version__, str(dtype))).encode()
                         + source).hexdigest()[:16]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return directory / f"{slug}-{str(dtype).removeprefix('torch.')}-{tag}.json"


_PLAN_FIELDS = ("block_m", "block_n", "block_k", "split_k", "k_per_split", "num_warps", "num_stages", "tma",
                "dependent")
_PLAN_INTS = _PLAN_FIELDS[:-2]
_PLAN_BOOLS = _PLAN_FIELDS[-2:]


def _entry_key(bucket: int, kind: MatrixKind, gated: bool = False) -> str:
    return f"{kind[0]}x{kind[1]}:{str(kind[2]).removeprefix('torch.')}:{bucket}{':gated' if gated else ''}"


def _read_cache(path: Path) -> dict[str, MatmulPlan | None]:
    """The choices kept in `path`, by `_entry_key`; none where it is missing, and none (with a warning) where it
    cannot be read or holds anything but well-formed plans."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as error:
        log.warning("cannot read the matmul choices in %s (%s): timing them again", path, error)
        return {}
    try:
        entries = json.loads(data.decode())
        if not isinstance(entries, dict):
            raise ValueError("not an object")
        return {key: None if value is None else _plan_from(value) for key, value in entries.items()}
    except (ValueError, TypeError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        log.warning("the matmul choices in %s are not readable (%s): timing them again", path, error)
        return {}


def _plan_from(value: Any) -> MatmulPlan:
    if not isinstance(value, dict) or set(value) != set(_PLAN_FIELDS):
        raise ValueError(f"a plan has the fields {', '.join(_PLAN_FIELDS)}, got {value!r}")
    if (not all(type(value[name]) is int and value[name] > 0 for name in _PLAN_INTS)
            or not all(type(value[name]) is bool for name in _PLAN_BOOLS)):
        raise ValueError(f"a plan's fields are positive integers and a true/false tma and dependent, got {value!r}")
    return MatmulPlan(**value)


def _fits(plan: MatmulPlan | None, bucket: int, kind: MatrixKind, num_multiprocessors: int, with_tma: bool,
          with_dependents: bool) -> bool:
    """Whether `plan` (None: torch's product) is one this code would time for `bucket` rows by a matrix of `kind`
    on this GPU (`with_tma`: it has the tensor memory accelerator; `with_dependents`: programmatic dependent
    launch): a file edited by hand, or written by other code, never launches what the kernel was not planned
    for."""
    if plan is None:
        return True
    n, k, storage = kind
    if plan.tma and not (with_tma and can_use_tma(k, storage.itemsize)):
        return False
    if plan.dependent and not with_dependents:
        return False
    return dataclasses.replace(plan, tma=False, dependent=False) in candidate_plans(
        bucket, n, k, num_multiprocessors, storage.itemsize)


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
        os.chmod(temporary, 0o644)  # readable by other users sharing the cache folder, as an ordinary file is
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        log.warning("cannot keep the matmul choices in %s (%s): the next start times them again", path, error)


def choose_matmuls(groups: Mapping[MatrixKind, Sequence[Matrix]], dtype: torch.dtype, device: torch.device,
                   num_multiprocessors: int, timer: Timer = cuda_graph_ms,
                   buckets: Sequence[int] = ROW_BUCKETS, cache: Path | None = None,
                   with_tma: bool | None = None, gated_kinds: Collection[MatrixKind] = ()) -> MatmulChoices:
    """For each kind of matrix (its matrices, every layer's, in `groups`) and each bucket, the fastest of the
    candidate plans and, for weights in `dtype`, torch's product, by `timer` over the whole group; for each of
    `gated_kinds` (an MLP's down projection) also whether reading the activation in beats its own kernel
    before that product. Choices already in the `cache` file are taken from it, and new ones added to it. A
    plan that does not compile or fit this GPU, or whose result differs from the reference, is left out (and
    logged); a quantized kind left with no plan widens its weight for torch's product. Any other failure (of
    the device, say) ends the timing and propagates. `with_tma`: time launches that read the weight through a
    tensor descriptor too (default: on a CUDA GPU of compute capability 9.0 or later, which copies them with
    its tensor memory accelerator)."""
    if with_tma is None:
        with_tma = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    with_dependents = launches_dependents(device)
    started = time.perf_counter()
    kept = _read_cache(cache) if cache is not None else {}
    plans: dict[tuple[int, MatrixKind], MatmulPlan | None] = {}
    gated: dict[tuple[int, MatrixKind], MatmulPlan | None] = {}
    generator = torch.Generator(device=device).manual_seed(0)
    timed: list[str] = []

    def take_kept(key: str, bucket: int, kind: MatrixKind) -> bool:
        if key in kept and _fits(kept[key], bucket, kind, num_multiprocessors, with_tma, with_dependents):
            return True
        if key in kept:
            log.warning("the kept matmul choice %s does not fit %s: timing it again", kept[key], key)
        timed.append(key)
        return False

    try:
        for kind, matrices in groups.items():
            for bucket in buckets:
                key = _entry_key(bucket, kind)
                tried: list[tuple[float, MatmulPlan]] = []
                if take_kept(key, bucket, kind):
                    plans[(bucket, kind)] = kept[key]
                else:
                    plans[(bucket, kind)], tried = _fastest(matrices, bucket, dtype, device, generator,
                                                            num_multiprocessors, timer, with_tma)
                if kind not in gated_kinds:
                    continue
                gated_key = _entry_key(bucket, kind, gated=True)
                if take_kept(gated_key, bucket, kind):
                    gated[(bucket, kind)] = kept[gated_key]
                else:
                    gated[(bucket, kind)] = _fastest_gated(matrices, bucket, dtype, device, generator, timer,
                                                           plans[(bucket, kind)], tried)
    finally:
        if device.type == "cuda":
            # The recordings' and references' memory back to the device: the KV cache is sized from what the
            # device has free.
            torch.cuda.empty_cache()
    if cache is not None and timed:
        # Another worker may have timed the same kinds since this one read the file: what the file holds now
        # wins, so that both run the same launches.
        now = _read_cache(cache)
        ours: dict[str, MatmulPlan | None] = {}
        for table, is_gated in ((plans, False), (gated, True)):
            for (bucket, kind), plan in table.items():
                key = _entry_key(bucket, kind, is_gated)
                if key in now and _fits(now[key], bucket, kind, num_multiprocessors, with_tma,
                                                   with_dependents):
                    table[(bucket, kind)] = now[key]
                elif plan is not None or is_gated or kind[2] == dtype:
                    # (A quantized kind that no plan served, out of memory, say, is not kept: timed again.)
                    ours[key] = plan
        _write_cache(cache, {**now, **ours})
    choices = MatmulChoices(num_multiprocessors, plans, gated)
    log.info("matrix products: %d choices timed in %.1f s, %d kept from %s; carpool's kernel serves:\n  %s",
             len(timed), time.perf_counter() - started, len(plans) + len(gated) - len(timed), cache or "no file",
             "\n  ".join(choices.describe()))
    return choices


def _first_of_fastest(timed: Sequence[tuple[float, MatmulPlan]]) -> tuple[float, MatmulPlan]:
    """The first plan within MIN_GAIN of the fastest, and its time: timing noise rarely moves the choice."""
    best_ms = min(ms for ms, _ in timed)
    return next((ms, plan) for ms, plan in timed if ms <= (1 + MIN_GAIN) * best_ms)


def _fastest(matrices: Sequence[Matrix], bucket: int, dtype: torch.dtype, device: torch.device,
             generator: torch.Generator, num_multiprocessors: int, timer: Timer,
             with_tma: bool) -> tuple[MatmulPlan | None, list[tuple[float, MatmulPlan]]]:
    """The launch for `bucket` rows by `matrices` (`_first_of_fastest`), or None (torch's product) where that is
    the faster, for a plain weight, or where no plan works; and every plan's time."""
    torch_ms, timed = time_launches(matrices, bucket, dtype, device, generator, num_multiprocessors, timer, with_tma)
    if not timed:
        return None, timed
    first_ms, first = _first_of_fastest(timed)
    if torch_ms is not None and first_ms > (1 - MIN_GAIN) * torch_ms:
        return None, timed
    return first, timed


def _fastest_gated(matrices: Sequence[Matrix], bucket: int, dtype: torch.dtype, device: torch.device,
                   generator: torch.Generator, timer: Timer, plain: MatmulPlan | None,
                   tried: Sequence[tuple[float, MatmulPlan]]) -> MatmulPlan | None:
    """For a down projection: the plan that reads the activation in, among the fastest few of the plain product
    (`tried`; the plain choice `plain` among them), where it beats the activation's own kernel followed by the
    plain choice by MIN_GAIN; else None."""
    k = matrices[0][0].shape[1]
    if plain is None and matrices[0][1] is not None:
        return None  # a quantized weight no plan serves: widened for torch's product, after the activation
    x = torch.randn((bucket, 2 * k), generator=generator, device=device).to(dtype)
    want = reference(silu_and_mul_rounded(x), matrices[0])
    apart_ms = timer(partial(each_activation_then_product, x, matrices, plain))
    tries = [plan for _, plan in sorted(tried, key=lambda item: item[0])[:GATED_TRIES]]
    if plain is not None and plain not in tries:
        tries.append(plain)
    timed = time_plans(x, matrices, tries, want, timer, gated=True)
    if not timed:
        return None
    first_ms, first = _first_of_fastest(timed)
    return first if first_ms <= (1 - MIN_GAIN) * apart_ms else None
