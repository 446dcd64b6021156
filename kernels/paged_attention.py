"""Paged attention over a block-table KV cache: Triton kernel, wrapper, torch reference.

Each scheduled sequence brings `q_len` new query tokens (1 for decode, a
chunk for prefill) that attend causally to its whole cached context of
`seq_len` tokens: query `i` sits at position `seq_len - q_len + i`. One
launch covers a mixed batch. A program owns (sequence, query tile, kv head);
its query tile stacks the GQA group's heads under each token, so every key
and value loaded from the cache serves all heads that share it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.dependent_launch import gdc_launch_dependents, launches_dependents
from kernels.interpret import check_launchable, is_interpreted
from kernels.split_kv import MIN_TOKENS_PER_SPLIT, combine_splits, num_multiprocessors, plan_kv_splits
from kernels.workspace import Workspace

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_ml_ptr,
    scale_log2,
    kv_split_min_len,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bts,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_mls,
    stride_mlt,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        # The output projection after this kernel may start and fetch its weight (`kernels/dependent_launch.py`).
        gdc_launch_dependents()
    seq = tl.program_id(0)
    q_tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kv_head = tl.program_id(2)

    # Where this sequence's new tokens sit in q/out, and how long its context is.
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_q_ptr + seq + 1) - tl.load(cu_seqlens_q_ptr + seq)).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    # Tile rows are (token, head-in-group) pairs: row r is token r // GROUP, head r % GROUP.
    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_tok = offs_m // GROUP
    offs_head = kv_head * GROUP + offs_m % GROUP
    is_row = offs_tok < q_len
    q_pos = seq_len - q_len + offs_tok
    offs_d = tl.arange(0, BLOCK_D)
    # Head dims such as 80 and 96 are padded up to BLOCK_D: mask the padding.
    is_d = offs_d < HEAD_DIM

    # Load the query tile once; it stays in registers for the whole KV sweep.
    q_rows = (q_start + offs_tok).to(tl.int64) * stride_qt + offs_head * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
        mask=is_row[:, None] & is_d[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Causality bounds the sweep by the tile's last query position; a tile past
    # the sequence's tokens sweeps nothing.
    last_tok = tl.minimum((q_tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = tl.where(q_tile * BLOCK_M < q_len * GROUP, seq_len - q_len + last_tok + 1, 0)
    # How many slices this sequence's context is cut into is decided here, from its
    # own length, never on the host: a launch recorded once (a CUDA graph) stays
    # right at any context. Only decoding sequences (one query token) split; the
    # grid's split axis is the most any sequence may use.
    num_splits = tl.where(q_len == 1, tl.minimum(tl.maximum(seq_len // kv_split_min_len, 1), NUM_SPLITS), 1)
    split_len = tl.cdiv(tl.cdiv(tl.maximum(kv_end, 1), num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * split_len
    # A program whose split this sequence does not use sweeps nothing and writes nothing.
    kv_hi = tl.where(split < num_splits, tl.minimum(kv_end, kv_lo + split_len), kv_lo)

    # Online softmax state in fp32 (log2 domain): running max, running sum, output.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start_n in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        is_key = offs_n < kv_hi
        # Translate key positions to cache rows through the block table (int64:
        # block * stride overflows int32 for large caches).
        blocks = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btb, mask=is_key, other=0)
        blocks = blocks.to(tl.int64)
        k_rows = blocks * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        v_rows = blocks * stride_vb + (offs_n % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_rows[None, :] + offs_d[:, None] * stride_kd,
            mask=is_key[None, :] & is_d[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd,
            mask=is_key[:, None] & is_d[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # Scores for the tile, causal per query position.
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        is_visible = (offs_n[None, :] <= q_pos[:, None]) & is_key[None, :]
        s = tl.where(is_visible, s, float("-inf"))

        # Online softmax: rescale what was accumulated to the new running max.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    is_out = is_row[:, None] & is_d[None, :]
    # An unsplit sequence normalises and writes its output rows here. Masks are
    # whole tiles (a vector per row), as the interpreter rejects a scalar beside a tile.
    splits_per_row = offs_m * 0 + num_splits
    is_direct = ((splits_per_row == 1) & (offs_m * 0 + split == 0))[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + offs_tok).to(tl.int64) * stride_ot + offs_head * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=is_out & is_direct,
    )
    if NUM_SPLITS > 1:
        # A split sequence leaves each slice's unnormalised result with its (max, sum) for the combine step.
        is_part = is_row & (split < splits_per_row) & (splits_per_row > 1)
        tok = (q_start + offs_tok).to(tl.int64)
        p_rows = split * stride_ps + tok * stride_pt + offs_head * stride_ph
        tl.store(part_out_ptr + p_rows[:, None] + offs_d[None, :], acc, mask=is_out & is_part[:, None])
        ml_rows = split * stride_mls + tok * stride_mlt + offs_head * stride_mlh
        tl.store(part_ml_ptr + ml_rows, m_i, mask=is_part)
        tl.store(part_ml_ptr + ml_rows + 1, l_i, mask=is_part)


def _query_tile_rows(rows_per_seq: int, head_dim: int, is_fp32: bool) -> int:
    """Rows per query tile: small for decode (few rows), 64 for prefill chunks."""
    largest = 32 if head_dim > 128 or is_fp32 else 64
    return min(largest, max(16, triton.next_power_of_2(rows_per_seq)))


def _pipeline(is_fp32: bool, head_dim: int) -> dict[str, int]:
    """Launch options beyond Triton's defaults: fp32 tiles of heads wider than 128 take 32 KB each for the keys
    and values of every pipeline stage, and with the default three stages and the queries' tile (about 224 KB)
    they would pass a Hopper GPU's 227 KB of shared memory, so they keep two."""
    return {"num_stages": 2} if is_fp32 and head_dim > 128 else {}



def kernels_are_interpreted() -> bool:
    """Whether this module's kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1 when `kernels` was
    first imported), rather than compiled for a GPU."""
    return is_interpreted(_paged_attention_kernel)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    kv_split_min_len: int = MIN_TOKENS_PER_SPLIT,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Triton paged attention; same contract as `paged_attention_reference`.

    Checks its arguments, then launches as `launch_paged_attention` does.
    `max_query_len` sizes the grid; pass it when known on the host to spare a
    device sync. `max_seq_len` is accepted for the backends' common signature
    and changes nothing: no launch setting depends on a context length.
    `num_kv_splits` sets the most slices a decoding context may be cut into
    (default: planned from the grid's size and the GPU's multiprocessors);
    each sequence takes one slice per `kv_split_min_len` tokens, up to that.
    """
    assert q.dim() == 3 and k_cache.dim() == 4, (q.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    num_seqs = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, block_tables.shape
    assert cu_seqlens_q.shape == (num_seqs + 1,), (cu_seqlens_q.shape, num_seqs)
    for meta in (block_tables, cu_seqlens_q, seq_lens):
        assert meta.dtype in (torch.int32, torch.int64), meta.dtype
    # The head_dim axis is addressed with a stride, but contiguous rows keep loads coalesced.
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert kv_split_min_len > 0, kv_split_min_len
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out)}
    assert len(devices) == 1, devices
    check_launchable(q.device, _paged_attention_kernel)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if num_kv_splits is None:
        num_kv_splits = plan_kv_splits(num_multiprocessors(q.device), num_seqs * num_kv_heads)
    launch_paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out,
                           max_query_len=max_query_len, num_kv_splits=num_kv_splits,
                           kv_split_min_len=kv_split_min_len, workspace=workspace)
    return out


def launch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    max_query_len: int,
    num_kv_splits: int,
    kv_split_min_len: int = MIN_TOKENS_PER_SPLIT,
    workspace: Workspace | None = None,
) -> None:
    """The launch alone, for callers that checked their layouts once (a model runner at start-up).

    Reads nothing from the device and decides nothing from a context length,
    so it can be recorded in a CUDA graph and replayed at any context: the
    grid depends only on the shapes, `max_query_len` and `num_kv_splits`.
    With a `workspace` the split buffers come from it (reserve them before a
    capture); without one they are allocated per call.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    # fp32 and wide heads use smaller tiles to stay within shared memory.
    is_fp32 = q.dtype == torch.float32
    block_m = _query_tile_rows(max_query_len * group, head_dim, is_fp32)
    block_n = 32 if head_dim > 128 or is_fp32 else 64
    num_q_tiles = triton.cdiv(max_query_len * group, block_m)
    # Splits serve decoding sequences only, and a decode step has one query tile per sequence.
    if num_q_tiles > 1:
        num_kv_splits = 1
    part_out = part_ml = out  # placeholders: a single-split launch never touches them
    if num_kv_splits > 1:
        part_shape = (num_kv_splits, num_tokens, num_heads)
        if workspace is None:
            part_out = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((*part_shape, 2), dtype=torch.float32, device=q.device)
        else:
            part_out = workspace.take("split_out", (*part_shape, head_dim), torch.float32, q.device)
            part_ml = workspace.take("split_ml", (*part_shape, 2), torch.float32, q.device)
    # The numpy interpreter gets bf16 `tl.dot` wrong, so there bf16 tiles are multiplied in fp32.
    dot_in_fp32 = q.dtype == torch.bfloat16 and is_interpreted(_paged_attention_kernel)
    grid = (seq_lens.shape[0], num_q_tiles * num_kv_splits, num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        part_out,
        part_ml,
        scale * _LOG2E,
        kv_split_min_len,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        *(part_out.stride()[:3]),
        *(part_ml.stride()[:3]),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_SPLITS=num_kv_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        LAUNCH_DEPENDENTS=launches_dependents(q.device),
        **_pipeline(is_fp32, head_dim),
    )
    if num_kv_splits > 1:
        combine_splits(part_out, part_ml, out, cu_seqlens_q, seq_lens, kv_split_min_len)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    **_launch_hints: int | None,
) -> torch.Tensor:
    """Each sequence's new queries attend causally to its cached context.

    Per sequence, the blocks are gathered into a contiguous context and
    handed to SDPA in fp32 with an explicit offset causal mask. Launch hints
    accepted by the Triton wrapper (`max_query_len`, ...) are ignored.
    """
    if out is None:
        out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    # One host sync for the metadata instead of one per sequence.
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, : math.ceil(seq_len / block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, D]
        values = v_cache[blocks].flatten(0, 1)[:seq_len]
        # [heads, len, D] layout for SDPA, fp32 for the accumulation.
        q_s = q[q_start:q_end].transpose(0, 1).float()
        k_s = keys.transpose(0, 1).float()
        v_s = values.transpose(0, 1).float()
        if num_kv_heads != num_heads:
            group = num_heads // num_kv_heads
            k_s = k_s.repeat_interleave(group, dim=0)
            v_s = v_s.repeat_interleave(group, dim=0)
        mask = None
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
        o_s = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o_s.transpose(0, 1).to(out.dtype)
    return out
