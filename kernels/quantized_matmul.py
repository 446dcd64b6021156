"""Weight-only quantized matmul for decode-sized batches: Triton kernels, plan, wrapper, torch reference.

`out[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n]` for activations `x [M, K]` (bf16, fp16 or fp32), a weight
`w [N, K]` held as int8 or float8_e4m3fn with one scale per output row, and `out [M, N]` in x's dtype. At
decode sizes the product is bound by reading the weight, so the kernel reads each weight byte once, in its
storage type, and widens it in registers (int8 and e4m3 values are exact in every activation dtype).
Products accumulate in fp32, the scale multiplies the fp32 sum, and the result is rounded once.

All M rows share one row tile (M <= MAX_ROWS), so no weight tile is read twice. A layer with few output tiles
(a 2048-wide projection is 32 tiles) would leave most of the GPU's multiprocessors idle, so K is cut into
`split_k` contiguous ranges swept by separate programs: each writes its fp32 partial sums to a workspace
`[split_k, M, N]`, and a second small kernel adds them in a fixed order (the same result on every run, no
atomics), scales and rounds. Block sizes come from a fixed table by M and the split from the multiprocessor
count, not from Triton's autotuner: a launch's configuration is known before a CUDA graph records it, start-up
times nothing, and every buffer is sized from shapes alone, so a call records into a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.interpret import check_launchable, is_interpreted
from kernels.split_kv import num_multiprocessors

# The kernel's regime: decode steps and small speculative batches. Larger products head towards compute-bound,
# where cuBLAS on the widened weight is the better tool.
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
def _quantized_matmul_kernel(
    x_ptr, w_ptr, scales_ptr, out_ptr, partial_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Grid: (output tile along N, K range). Every row of x is in the one row tile.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_m = offs_m < M
    is_n = offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # This program's K range: k_per_split is a multiple of BLOCK_K, and blocks past K load nothing.
    k_start = pid_k * k_per_split
    for k in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k + tl.arange(0, BLOCK_K)
        is_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=is_m[:, None] & is_k[None, :],
                    other=0.0)
        # The weight tile read in its storage type, as [BLOCK_K, BLOCK_N], and widened in registers.
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=is_k[:, None] & is_n[None, :],
                    other=0.0)
        if DOT_IN_FP32:
            # Full fp32 products, not tf32, so an fp32 model gets fp32 results.
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(dtype), acc)
    if IS_SPLIT:
        # A partial sum of this K range, unscaled: the reduction kernel adds the ranges, scales and rounds.
        partial = partial_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :]
        tl.store(partial, acc, mask=is_m[:, None] & is_n[None, :])
    else:
        # The per-row scale on the fp32 sum, then one rounding to the activations' dtype.
        scales = tl.load(scales_ptr + offs_n, mask=is_n, other=0.0).to(tl.float32)
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, (acc * scales[None, :]).to(out_ptr.dtype.element_ty), mask=is_m[:, None] & is_n[None, :])


@triton.jit
def _quantized_matmul_reduce_kernel(
    partial_ptr, scales_ptr, out_ptr,
    N, split_k,
    stride_ps, stride_pm, stride_om,
    BLOCK_N: tl.constexpr,
):
    # Grid: (row, column tile). The ranges' partial sums are added in order, then scaled and rounded once.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(partial_ptr + s * stride_ps + row * stride_pm + offs_n, mask=is_n, other=0.0)
    scales = tl.load(scales_ptr + offs_n, mask=is_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, (acc * scales).to(out_ptr.dtype.element_ty), mask=is_n)


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


@dataclass(frozen=True)
class _Blocks:
    max_rows: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# By the number of rows, the first that holds them. The row block is the smallest power of two >= 16 (the
# least tl.dot takes) holding every row, so the weight is read once. 64 x 128 weight tiles are 8 KiB of int8
# per pipeline stage: with a few stages in flight per program and two programs per multiprocessor, enough
# loads are outstanding to keep HBM busy, and the x tile beside them (16-64 rows) stays small. Fewer stages
# for 64 rows, whose x tiles (16 KiB in bf16) take more shared memory.
_BLOCKS = (
    _Blocks(max_rows=16, block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    _Blocks(max_rows=32, block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4),
    _Blocks(max_rows=MAX_ROWS, block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
)


def plan_quantized_matmul(m: int, n: int, k: int, num_multiprocessors: int) -> MatmulPlan:
    """The launch for `[m, k] x [n, k]^T` on a GPU of `num_multiprocessors` (0: no split, as on CPU).

    K is split only when the output tiles alone leave multiprocessors idle, into enough ranges for
    PROGRAMS_PER_MULTIPROCESSOR programs each, but never so many that a range is shorter than
    MIN_K_BLOCKS_PER_SPLIT blocks or that the partial sums (written and read back in fp32) come to more than
    half the weight's bytes. Depends on shapes alone, so a recorded graph replays the same launch.
    """
    assert 0 < m <= MAX_ROWS and n > 0 and k > 0, (m, n, k)
    blocks = next(b for b in _BLOCKS if m <= b.max_rows)
    num_tiles = triton.cdiv(n, blocks.block_n)
    num_k_blocks = triton.cdiv(k, blocks.block_k)
    split_k = 1
    if num_tiles < num_multiprocessors:
        wanted = triton.cdiv(PROGRAMS_PER_MULTIPROCESSOR * num_multiprocessors, num_tiles)
        # Partial-sum traffic 2 * split_k * m * n * 4 bytes against the weight's n * k.
        by_traffic = k // (16 * m)
        split_k = max(1, min(wanted, MAX_SPLIT_K, by_traffic, num_k_blocks // MIN_K_BLOCKS_PER_SPLIT))
    # Whole blocks per range, and no empty range at the end.
    blocks_per_split = triton.cdiv(num_k_blocks, split_k)
    split_k = triton.cdiv(num_k_blocks, blocks_per_split)
    return MatmulPlan(blocks.block_m, blocks.block_n, blocks.block_k, split_k, blocks_per_split * blocks.block_k,
                      blocks.num_warps, blocks.num_stages)


def quantized_matmul(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                     plan: MatmulPlan | None = None) -> torch.Tensor:
    """`(x @ data^T) * scales` for `x [M, K]`, `data [N, K]` int8 or float8_e4m3fn (or in x's dtype, unquantized,
    as a benchmark's baseline), `scales [N]`; `[M, N]` in x's dtype. `plan` defaults to `plan_quantized_matmul`
    for x's device."""
    assert x.dim() == 2 and data.dim() == 2 and x.shape[1] == data.shape[1], (x.shape, data.shape)
    assert x.dtype in ACTIVATION_DTYPES and data.dtype in (*STORAGE_DTYPES, x.dtype), (x.dtype, data.dtype)
    assert scales.shape == (data.shape[0],) and scales.dtype in ACTIVATION_DTYPES, (scales.shape, scales.dtype)
    # Element offsets into the weight are 32-bit in the kernel.
    assert data.numel() < 2**31, data.shape
    assert x.stride(1) == 1 and data.is_contiguous() and scales.is_contiguous(), (x.stride(), data.stride())
    assert x.device == data.device == scales.device, (x.device, data.device, scales.device)
    m, k = x.shape
    n = data.shape[0]
    assert m <= MAX_ROWS, f"{m} rows: more than the {MAX_ROWS} this kernel is planned for"
    check_launchable(x.device, _quantized_matmul_kernel)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if plan is None:
        plan = plan_quantized_matmul(m, n, k, num_multiprocessors(x.device))
    assert plan.block_m >= m and plan.k_per_split % plan.block_k == 0, plan
    assert plan.split_k * plan.k_per_split >= k, plan
    is_split = plan.split_k > 1
    # The numpy interpreter gets bf16 `tl.dot` (and int8-to-bf16 conversion) wrong: there bf16 multiplies in fp32.
    dot_in_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and is_interpreted(_quantized_matmul_kernel))
    # Sized by shapes alone: a graph records the allocation, and nothing is read back to the host.
    partial = torch.empty((plan.split_k, m, n) if is_split else (1, 1, 1), dtype=torch.float32, device=x.device)
    _quantized_matmul_kernel[(triton.cdiv(n, plan.block_n), plan.split_k)](
        x, data, scales, out, partial,
        m, n, k, plan.k_per_split,
        x.stride(0), data.stride(0), out.stride(0), partial.stride(0), partial.stride(1),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, IS_SPLIT=is_split,
        DOT_IN_FP32=dot_in_fp32, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if is_split:
        # Short column tiles: a few more programs to spread the (small) reduction over.
        block = min(256, triton.next_power_of_2(n))
        _quantized_matmul_reduce_kernel[(m, triton.cdiv(n, block))](
            partial, scales, out, n, plan.split_k, partial.stride(0), partial.stride(1), out.stride(0),
            BLOCK_N=block)
    return out


def quantized_matmul_reference(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same product in fp32 with one rounding to x's dtype at the end."""
    return ((x.float() @ data.float().T) * scales.float()).to(x.dtype)
