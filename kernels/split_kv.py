"""Split-KV for long-context decode: when a batch has too few (sequence, kv head)
programs to fill the GPU, each decoding context is cut into slices swept in
parallel, and a second kernel merges the slices' partial softmax results.

How many slices a sequence takes is decided on the device from its own
length (one per `kv_split_min_len` tokens, up to the launch's maximum), so a
launch recorded once stays right at every context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import gdc_launch_dependents, launches_dependents

# Slices shorter than this spend more on the merge than they win in parallelism.
MIN_TOKENS_PER_SPLIT = 1024  # a context splits only from 2 * this tokens on
MAX_SPLITS = 16


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    kv_split_min_len,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_mls,
    stride_mlt,
    stride_mlh,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    MAX_NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        # The output projection after this kernel may start and fetch its weight (`kernels/dependent_launch.py`).
        gdc_launch_dependents()
    # One program per (sequence, head): merge its decode token's partial results over the splits.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - tl.load(cu_seqlens_q_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The same count the attention kernel chose; an unsplit sequence already wrote its output.
    num_splits = tl.where(q_len == 1, tl.minimum(tl.maximum(seq_len // kv_split_min_len, 1), MAX_NUM_SPLITS), 1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # Masks are whole vectors: the interpreter rejects a scalar beside a tile.
    is_split = (offs_s < num_splits) & (offs_s * 0 + num_splits > 1)
    is_d = offs_d < HEAD_DIM
    is_merged = is_d & (offs_d * 0 + num_splits > 1)

    # Each split's running max (log2 domain) and sum of exponentials.
    ml = part_ml_ptr + offs_s * stride_mls + token * stride_mlt + head * stride_mlh
    m = tl.load(ml, mask=is_split, other=-1.0e30)
    l = tl.load(ml + 1, mask=is_split, other=0.0)

    # Rescale every split to the global max, then normalise once.
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - m_max)
    denom = tl.sum(weight * l, axis=0)
    rows = part_out_ptr + offs_s * stride_ps + token * stride_pt + head * stride_ph
    acc = tl.load(rows[:, None] + offs_d[None, :], mask=is_split[:, None] & is_d[None, :], other=0.0)
    o = tl.sum(acc * weight[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=is_merged,
    )


def combine_splits(part_out: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   seq_lens: torch.Tensor, kv_split_min_len: int) -> None:
    """Merge `part_out [max_splits, T, H, D]` (unnormalised) with `part_ml [max_splits, T, H, 2]` into `out`.

    Only sequences that split (one query token, a context of at least two
    slices) are written; the attention kernel wrote the others directly.
    """
    max_splits, num_tokens, num_heads, head_dim = part_out.shape
    assert part_ml.shape == (max_splits, num_tokens, num_heads, 2), part_ml.shape
    assert out.shape == (num_tokens, num_heads, head_dim), out.shape
    assert part_out.stride(-1) == 1 and part_ml.stride(-1) == 1
    assert part_out.dtype == part_ml.dtype == torch.float32
    _combine_splits_kernel[(seq_lens.shape[0], num_heads)](
        part_out,
        part_ml,
        out,
        cu_seqlens_q,
        seq_lens,
        kv_split_min_len,
        *part_out.stride()[:3],
        *part_ml.stride()[:3],
        *out.stride(),
        HEAD_DIM=head_dim,
        MAX_NUM_SPLITS=max_splits,
        BLOCK_S=max(2, triton.next_power_of_2(max_splits)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        LAUNCH_DEPENDENTS=launches_dependents(out.device),
    )


def num_multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count; 0 off CUDA (no split pays there)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_kv_splits(num_multiprocessors: int, num_programs: int) -> int:
    """The most slices a decoding context may be cut into: 1 unless the GPU would sit mostly idle.

    Depends only on how many (sequence, kv head) programs the launch has, never
    on a context length, so one plan serves every step of a batch size.
    """
    if num_programs <= 0 or num_programs >= num_multiprocessors:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_multiprocessors, num_programs)))
