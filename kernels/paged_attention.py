"""Paged attention over a block-table KV cache: reference in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's new queries attend causally to its cached context.

    Query `i` of a sequence with `q_len` new tokens and context `seq_len`
    sits at position `seq_len - q_len + i`. Per sequence, the blocks are
    gathered into a contiguous context and handed to SDPA in fp32.
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
        num_seq_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_seq_blocks].long()
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
