"""Matrix products of decode-sized batches, bound by reading the weight: Triton kernels, plans, wrapper, reference.

`out[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n]` for activations `x [M, K]` (bf16, fp16 or fp32), a weight
`w [N, K]` held in x's dtype or as int8 / float8_e4m3fn with one scale per output row (no scales: a plain
product), and `out [M, N]` in x's dtype. With a few rows, the product costs what reading the weight costs, so
the kernel reads each weight element once, in its storage type, and widens it in registers (int8 and e4m3
values are exact in every activation dtype). Products accumulate in fp32, the scale multiplies the fp32 sum,
and the result is rounded once.

All M rows share one row tile (M <= MAX_ROWS), so no weight tile is read twice. A layer with few output tiles
(a 2048-wide projection is 32 tiles of 64) would leave most of the GPU's multiprocessors idle, so K is cut
into `split_k` contiguous ranges swept by separate programs: each writes its fp32 partial sums to a workspace
`[split_k, M, N]`, and a second small kernel adds them in a fixed order (the same result on every run, no
atomics), scales and rounds. Row and column indices past the edges are clamped, not masked (their results are
never stored), and each K range stops at K, so where K is a whole number of K blocks the loads carry no mask
at all.

On a Hopper GPU or later a plan may read the weight through a tensor descriptor instead (`tma`): its tensor
memory accelerator copies each `[BLOCK_N, BLOCK_K]` tile, zeros past N and K, without the threads computing
addresses; the descriptor is made on the host at each launch and travels in the launch's arguments, so a
recorded graph keeps it. A plan may also be `dependent`: launched to start while the kernel before it ends,
it waits for x before it reads or writes anything (`kernels/dependent_launch.py`).

A launch's blocks and split are a `MatmulPlan`, known before a CUDA graph records the launch; every buffer is
sized from shapes alone. `plan_decode_matmul` gives one from a fixed table by M and the multiprocessor count;
`candidate_plans` gives the few that `worker.engine.models.matmul_choice` times on the GPU at start-up (with
torch's own product beside them) to keep the fastest for each of a model's matrices. A row's result depends
on the plan's K ranges and block, never on M: a plan serves any number of rows up to its row block alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import gdc_launch_dependents, gdc_wait, launches_dependents
from kernels.interpret import check_launchable, is_interpreted

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: no TMA launches
    TensorDescriptor = None
from kernels.split_kv import num_multiprocessors

# The kernel's regime: decode steps and small speculative batches. Larger products head towards compute-bound,
# where cuBLAS is the better tool.
MAX_ROWS = 64
STORAGE_DTYPES = (torch.int8, torch.float8_e4m3fn)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# More ranges than this add partial sums to write and read back for little more parallelism.
MAX_SPLIT_K = 16
# A range of fewer K blocks gives its program too little to overlap its loads with.
MIN_K_BLOCKS_PER_SPLIT = 2
# Programs to aim for per multiprocessor when splitting, so one program's loads overlap another's.
PROGRAMS_PER_MULTIPROCESSOR = 2


@triton.jit
def _decode_matmul_kernel(
    x_ptr, w_ptr, w_desc, scales_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    GATED: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    # Grid: (output tile along N, K range). Every row of x is in the one row tile.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edges read the last real one: their sums are computed and never stored.
    rows = tl.minimum(offs_m, M - 1)
    cols = tl.minimum(offs_n, N - 1)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # This program's K range: k_per_split is a multiple of BLOCK_K, and the last range stops at K. With EVEN_K
    # (K a multiple of BLOCK_K) every block of every range lies inside K.
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if DEPENDENT:
        # Launched to start while the kernel before it ends (`kernels/dependent_launch.py`): the kernel after
        # this one may start in turn, and this one waits for x before it reads or writes anything.
        gdc_launch_dependents()
        gdc_wait()
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_start + offs_k)[None, :]
    # The weight tile read in its storage type, as [BLOCK_K, BLOCK_N] (K contiguous), and widened in registers.
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k_start + offs_k)[:, None]
    for k in range(k_start, k_end, BLOCK_K):
        is_k = k + offs_k < K
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=is_k[None, :], other=0.0)
        if GATED:
            # x's row holds gate then up, K each: SiLU(gate) * up as `kernels/norm_act.py` rounds it (SiLU in
            # fp32 rounded to the dtype, then the product rounded), so the fused product gives the same bits.
            if EVEN_K:
                up = tl.load(x_ptrs + K)
            else:
                up = tl.load(x_ptrs + K, mask=is_k[None, :], other=0.0)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(dtype)
        if USE_TMA:
            # The tile copied by the tensor memory accelerator through the weight's descriptor, as [BLOCK_N,
            # BLOCK_K] with zeros past N and K, then seen transposed.
            w = tl.trans(w_desc.load([pid_n * BLOCK_N, k]))
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=is_k[:, None], other=0.0)
        if DOT_IN_FP32:
            # Full fp32 products, not tf32, so an fp32 model gets fp32 results.
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    is_out = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if IS_SPLIT:
        # A partial sum of this K range, unscaled: the reduction kernel adds the ranges, scales, adds the bias
        # and rounds.
        partial = partial_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :]
        tl.store(partial, acc, mask=is_out)
    else:
        if HAS_SCALES:
            # The per-row scale on the fp32 sum, then the bias, then one rounding to the activations' dtype.
            acc = acc * tl.load(scales_ptr + cols).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_out)


@triton.jit
def _decode_matmul_reduce_kernel(
    partial_ptr, scales_ptr, bias_ptr, out_ptr,
    N, split_k,
    stride_ps, stride_pm, stride_om,
    BLOCK_N: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # Grid: (row, column tile). The ranges' partial sums are added in order, then scaled and rounded once.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(partial_ptr + s * stride_ps + row * stride_pm + offs_n, mask=is_n, other=0.0)
    if HAS_SCALES:
        acc = acc * tl.load(scales_ptr + offs_n, mask=is_n, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=is_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=is_n)


@dataclass(frozen=True)
class MatmulPlan:
    """One launch's blocks and K split: `split_k` ranges of `k_per_split` (a multiple of `block_k`) each."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int
    num_stages: int
    tma: bool = False
    """The weight read through a tensor descriptor (the tensor memory accelerator of Hopper GPUs and later)."""
    dependent: bool = False
    """Launched to start while the kernel before it ends, waiting for x before it reads or writes anything
    (programmatic dependent launch, Hopper GPUs and later: `kernels/dependent_launch.py`)."""

    def describe(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} blocks, {self.split_k} K range"
                f"{'s' if self.split_k > 1 else ''}, {self.num_warps} warps, {self.num_stages} stages"
                f"{', TMA' if self.tma else ''}{', dependent launch' if self.dependent else ''}")


@dataclass(frozen=True)
class _Blocks:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The default blocks, by row block (16, 32, 64: the smallest power of two >= 16, the least tl.dot takes,
# holding every row, so the weight is read once). 64 x 128 weight tiles are 8 KiB of int8 per pipeline stage:
# with a few stages in flight per program and two programs per multiprocessor, enough loads are outstanding to
# keep HBM busy, and the x tile beside them stays small. Fewer stages for 64 rows, whose x tiles (16 KiB in
# bf16) take more shared memory.
_DEFAULT_BLOCKS = {16: _Blocks(64, 128, 4, 4), 32: _Blocks(64, 128, 4, 4), 64: _Blocks(64, 128, 4, 3)}
# What `candidate_plans` offers beside the default, by row block: narrower column tiles (more programs, for
# layers whose tiles leave multiprocessors half-filled), longer K blocks (more bytes per load), and wider
# tiles over more warps (fewer programs, each streaming more). In bf16 the largest hold up to 144 KiB of
# shared memory over their stages, one program per multiprocessor on an H100 (the default blocks fit two):
# the timing keeps them only where that pays.
_CANDIDATE_BLOCKS = {
    16: (_Blocks(32, 256, 4, 4), _Blocks(64, 256, 4, 3), _Blocks(128, 128, 8, 4)),
    32: (_Blocks(32, 256, 4, 4), _Blocks(64, 256, 4, 3), _Blocks(128, 128, 8, 3)),
    64: (_Blocks(32, 256, 4, 3), _Blocks(64, 128, 8, 3), _Blocks(128, 64, 8, 3)),
}


def row_block(m: int) -> int:
    """The row tile that holds `m` rows (1 <= m <= MAX_ROWS)."""
    assert 0 < m <= MAX_ROWS, m
    return max(16, triton.next_power_of_2(m))


def _plan(blocks: _Blocks, block_m: int, split_k: int, k: int) -> MatmulPlan:
    # Whole blocks per range, and no empty range at the end.
    num_k_blocks = triton.cdiv(k, blocks.block_k)
    blocks_per_split = triton.cdiv(num_k_blocks, split_k)
    split_k = triton.cdiv(num_k_blocks, blocks_per_split)
    return MatmulPlan(block_m, blocks.block_n, blocks.block_k, split_k, blocks_per_split * blocks.block_k,
                      blocks.num_warps, blocks.num_stages)


def _split_for(blocks: _Blocks, m: int, n: int, k: int, num_multiprocessors: int, weight_bytes: int,
               programs_per_multiprocessor: int) -> int:
    """The K split that gives the GPU `programs_per_multiprocessor` programs per multiprocessor (1 where the
    output tiles alone do); never so many that a range is shorter than MIN_K_BLOCKS_PER_SPLIT blocks or that
    the partial sums (written and read back in fp32) come to more than half the weight's bytes (`weight_bytes`
    an element)."""
    wanted = triton.cdiv(programs_per_multiprocessor * num_multiprocessors, triton.cdiv(n, blocks.block_n))
    # Partial-sum traffic 2 * split_k * m * n * 4 bytes against the weight's n * k * weight_bytes.
    by_traffic = k * weight_bytes // (16 * m)
    by_length = triton.cdiv(k, blocks.block_k) // MIN_K_BLOCKS_PER_SPLIT
    return max(1, min(wanted, MAX_SPLIT_K, by_traffic, by_length))


def _filling_split(blocks: _Blocks, m: int, n: int, k: int, num_multiprocessors: int) -> int:
    """The default plan's split: none where the output tiles alone give every multiprocessor a program, else
    PROGRAMS_PER_MULTIPROCESSOR programs per multiprocessor."""
    if triton.cdiv(n, blocks.block_n) >= num_multiprocessors:
        return 1
    return _split_for(blocks, m, n, k, num_multiprocessors, 1, PROGRAMS_PER_MULTIPROCESSOR)


def plan_decode_matmul(m: int, n: int, k: int, num_multiprocessors: int) -> MatmulPlan:
    """The default launch for `[m, k] x [n, k]^T` on a GPU of `num_multiprocessors` (0: no split, as on CPU).

    K is split only when the output tiles alone leave multiprocessors idle (`_filling_split`). Depends on
    shapes alone, so a recorded graph replays the same launch."""
    assert 0 < m <= MAX_ROWS and n > 0 and k > 0, (m, n, k)
    block_m = row_block(m)
    blocks = _DEFAULT_BLOCKS[block_m]
    return _plan(blocks, block_m, _filling_split(blocks, m, n, k, num_multiprocessors), k)


def can_use_tma(k: int, weight_bytes: int) -> bool:
    """Whether a `[n, k]` weight of `weight_bytes` an element can be read through a tensor descriptor: this
    Triton has them, and a row is a whole number of 16 bytes (the accelerator's alignment)."""
    return TensorDescriptor is not None and k * weight_bytes % 16 == 0


def candidate_plans(m: int, n: int, k: int, num_multiprocessors: int, weight_bytes: int = 1,
                    with_tma: bool = False) -> list[MatmulPlan]:
    """The launches worth timing for `[m, k] x [n, k]^T` on this GPU, for a weight of `weight_bytes` an element:
    the default plan first, then the default blocks and each candidate block shape with the K split that gives
    every multiprocessor two programs and four (evening out the last wave where the tiles alone leave some
    with one program more), and unsplit; with `with_tma` (a Hopper GPU or later) each of those again reading
    the weight through a tensor descriptor, where `can_use_tma`; no two alike. (The split is a launch
    argument, not a compiled variant: more of them cost timing at start-up, not compiles.)"""
    block_m = row_block(m)
    plans = [plan_decode_matmul(m, n, k, num_multiprocessors)]
    for tma in (False, True) if with_tma and can_use_tma(k, weight_bytes) else (False,):
        for blocks in (_DEFAULT_BLOCKS[block_m], *_CANDIDATE_BLOCKS[block_m]):
            for split_k in (*(_split_for(blocks, m, n, k, num_multiprocessors, weight_bytes, programs)
                              for programs in (PROGRAMS_PER_MULTIPROCESSOR, 2 * PROGRAMS_PER_MULTIPROCESSOR)), 1):
                plan = dataclasses.replace(_plan(blocks, block_m, split_k, k), tma=tma)
                if plan not in plans:
                    plans.append(plan)
    return plans


def decode_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
                  plan: MatmulPlan | None = None, gated: bool = False,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`(x @ weight^T) * scales + bias` for `x [M, K]`, `weight [N, K]` in x's dtype or int8 / float8_e4m3fn,
    `scales [N]` (None: no scaling) and `bias [N]` (None: none), rounded once; `[M, N]` in x's dtype. `plan`
    defaults to `plan_decode_matmul` for x's device; it must hold M rows in its row block. `gated`: x is
    `[M, 2K]`, gate then up, and the product is of `silu_and_mul(x)` (an MLP's down projection with its
    activation read in)."""
    assert x.dim() == 2 and weight.dim() == 2, (x.shape, weight.shape)
    assert x.shape[1] == (2 if gated else 1) * weight.shape[1], (x.shape, weight.shape, gated)
    assert x.dtype in ACTIVATION_DTYPES and weight.dtype in (*STORAGE_DTYPES, x.dtype), (x.dtype, weight.dtype)
    if scales is not None:
        assert scales.shape == (weight.shape[0],) and scales.dtype in ACTIVATION_DTYPES, (scales.shape, scales.dtype)
        assert scales.is_contiguous() and scales.device == x.device, (scales.stride(), scales.device)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.is_contiguous() and bias.device == x.device, bias.shape
    # Element offsets into the weight are 32-bit in the kernel.
    assert weight.numel() < 2**31, weight.shape
    assert x.stride(1) == 1 and weight.is_contiguous(), (x.stride(), weight.stride())
    assert x.device == weight.device, (x.device, weight.device)
    m, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"{m} rows: more than the {MAX_ROWS} this kernel is planned for"
    check_launchable(x.device, _decode_matmul_kernel)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if plan is None:
        plan = plan_decode_matmul(m, n, k, num_multiprocessors(x.device))
    assert plan.block_m >= m and plan.k_per_split % plan.block_k == 0, plan
    assert plan.split_k * plan.k_per_split >= k, plan
    is_split = plan.split_k > 1
    # The numpy interpreter gets bf16 `tl.dot` (and int8-to-bf16 conversion) wrong: there bf16 multiplies in fp32.
    dot_in_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and is_interpreted(_decode_matmul_kernel))
    # Sized by shapes alone: a graph records the allocation, and nothing is read back to the host.
    partial = torch.empty((plan.split_k, m, n) if is_split else (1, 1, 1), dtype=torch.float32, device=x.device)
    scale_arg = scales if scales is not None else out  # never read without HAS_SCALES
    bias_arg = bias if bias is not None else out  # nor this without HAS_BIAS
    if plan.dependent:
        assert launches_dependents(x.device), f"{x.device} cannot launch a kernel's dependents early"
    descriptor = None
    if plan.tma:
        assert TensorDescriptor is not None and can_use_tma(k, weight.element_size()), (k, weight.dtype)
        descriptor = TensorDescriptor.from_tensor(weight, [plan.block_n, plan.block_k])
    _decode_matmul_kernel[(triton.cdiv(n, plan.block_n), plan.split_k)](
        x, weight, descriptor, scale_arg, bias_arg, out, partial,
        m, n, k, plan.k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), partial.stride(0), partial.stride(1),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, IS_SPLIT=is_split,
        HAS_SCALES=scales is not None, HAS_BIAS=bias is not None, EVEN_K=k % plan.block_k == 0, USE_TMA=plan.tma,
        GATED=gated,
        DOT_IN_FP32=dot_in_fp32, DEPENDENT=plan.dependent, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **({"launch_pdl": True} if plan.dependent else {}),
    )
    if is_split:
        # Short column tiles: a few more programs to spread the (small) reduction over.
        block = min(256, triton.next_power_of_2(n))
        _decode_matmul_reduce_kernel[(m, triton.cdiv(n, block))](
            partial, scale_arg, bias_arg, out, n, plan.split_k, partial.stride(0), partial.stride(1), out.stride(0),
            BLOCK_N=block, HAS_SCALES=scales is not None, HAS_BIAS=bias is not None)
    return out


def silu_and_mul_rounded(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of `[M, 2K]` rows, rounded as the gated kernel (and `kernels/norm_act.py`) round it."""
    gate, up = x.float().chunk(2, dim=-1)
    return ((gate / (1.0 + torch.exp(-gate))).to(x.dtype).float() * up).to(x.dtype)


def decode_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
                            gated: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in fp32 with one rounding to x's dtype at the end (of the rounded activation, gated)."""
    product = (silu_and_mul_rounded(x) if gated else x).float() @ weight.float().T
    if scales is not None:
        product = product * scales.float()
    return (product if bias is None else product + bias.float()).to(x.dtype)
