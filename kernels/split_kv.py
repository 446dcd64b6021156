"""Split-KV for long-context decode: when a batch has too few (sequence, kv head)
programs to fill the GPU, each context is cut into slices swept in parallel,
and a second kernel merges the slices' partial softmax results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Slices shorter than this spend more on the merge than they win in parallelism.
MIN_TOKENS_PER_SPLIT = 1024  # splits only when max_seq_len >= 2 * this
MAX_SPLITS = 16


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
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
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, head): merge its partial results over the splits.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    is_split = offs_s < num_splits
    is_d = offs_d < HEAD_DIM

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
    o = tl.sum(acc * weight[:, None], axis=0) / denom
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=is_d,
    )


def combine_splits(part_out: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """Merge `part_out [splits, T, H, D]` (unnormalised) with `part_ml [splits, T, H, 2]` into `out`."""
    num_splits, num_tokens, num_heads, head_dim = part_out.shape
    assert part_ml.shape == (num_splits, num_tokens, num_heads, 2), part_ml.shape
    assert out.shape == (num_tokens, num_heads, head_dim), out.shape
    assert part_out.stride(-1) == 1 and part_ml.stride(-1) == 1
    assert part_out.dtype == part_ml.dtype == torch.float32
    _combine_splits_kernel[(num_tokens, num_heads)](
        part_out,
        part_ml,
        out,
        num_splits,
        *part_out.stride()[:3],
        *part_ml.stride()[:3],
        *out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def plan_kv_splits(
    device: torch.device, num_programs: int, max_seq_len: int | None, seq_lens: torch.Tensor
) -> int:
    """How many slices to cut each context into: 1 unless the GPU would sit mostly idle."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_programs >= num_sms:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))
