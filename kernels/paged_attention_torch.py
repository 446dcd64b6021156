"""Paged attention and the KV store in batched plain torch: the CPU backend.

Same contract as `paged_attention_reference` (kernels/paged_attention.py),
which stays the test oracle. Where the reference gathers and attends one
sequence at a time, this gathers the blocks of many sequences with one index
op into a padded `[num_seqs, context, kv_heads, head_dim]` and runs one SDPA
over them with a length mask. Decode sequences (one new token) are attended
together; each prefill chunk is attended on its own, so a long chunk never
pads the decode rows up to its length.

GQA costs no copies: as in the Triton kernel, the query rows of one kv head
are (token, head of its group) pairs, so each kv head's keys serve all the
query heads that share it.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.kv_store import store_kv_reference


def paged_attention_torch(
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
    **_launch_hints: int | None,
) -> torch.Tensor:
    """Batched paged attention; `max_query_len` / `max_seq_len` (host ints) spare host reads.

    With `max_query_len == 1` (a decode-only step) nothing is read back to
    the host; a step with prefill chunks reads its query offsets once.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape)
    assert q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_query_len == 1:
        # Every sequence brings exactly one token, so token row s is sequence s.
        assert q.shape[0] == num_seqs, (q.shape, num_seqs)
        o = _attend(q.unsqueeze(1), k_cache, v_cache, block_tables, seq_lens - 1, scale, max_seq_len)
        out.copy_(o.squeeze(1))
        return out

    starts = cu_seqlens_q.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if decodes:
        seqs = torch.tensor(decodes, device=q.device)
        rows = cu_seqlens_q[:-1][seqs].long()
        last_pos = seq_lens[seqs] - 1
        o = _attend(q[rows].unsqueeze(1), k_cache, v_cache, block_tables[seqs], last_pos, scale, max_seq_len)
        out[rows] = o.squeeze(1).to(out.dtype)
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start = starts[s]
        # Query i of the chunk sits at position seq_len - q_len + i.
        first_pos = seq_lens[s : s + 1] - q_len
        o = _attend(q[start : start + q_len].unsqueeze(0), k_cache, v_cache, block_tables[s : s + 1],
                    first_pos, scale, max_seq_len)
        out[start : start + q_len] = o.squeeze(0).to(out.dtype)
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    first_pos: torch.Tensor,
    scale: float,
    max_seq_len: int | None,
) -> torch.Tensor:
    """Causal attention of `q` `[n, q_len, heads, d]` (query i at `first_pos + i`) over n paged contexts.

    Returns fp32 `[n, q_len, heads, d]`.
    """
    n, q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # Gather whole blocks: enough of them for the longest context, which the hint bounds without a host read.
    num_blocks = block_tables.shape[1] if max_seq_len is None else min(-(-max_seq_len // block_size),
                                                                       block_tables.shape[1])
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    context = num_blocks * block_size
    # index_select copies whole blocks at memcpy speed, where advanced indexing goes element by element.
    # [n, context, kv_heads, d] -> [n, kv_heads, context, d], fp32 for the accumulation.
    keys = k_cache.index_select(0, blocks).view(n, context, num_kv_heads, head_dim).transpose(1, 2).float()
    values = v_cache.index_select(0, blocks).view(n, context, num_kv_heads, head_dim).transpose(1, 2).float()
    # Rows of kv head h: (token i, head g of its group), token-major.
    rows = q.view(n, q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    rows = rows.reshape(n, num_kv_heads, q_len * group, head_dim).float()
    # A key is visible to query i when it sits at or before the query's position; that also
    # hides the gathered slots past the context, as every query sits inside it.
    q_pos = first_pos[:, None] + torch.arange(q_len, device=q.device)
    k_pos = torch.arange(context, device=q.device)
    is_visible = k_pos[None, None, :] <= q_pos[:, :, None]
    mask = is_visible[:, None, :, None, :].expand(n, 1, q_len, group, context).reshape(n, 1, q_len * group, context)
    o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    return o.view(n, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4).reshape(n, q_len, num_heads, head_dim)


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `store_kv_reference`; one `index_copy_` per cache when no token is padding.

    The runner never pads, so the masked reference path only runs for a
    slot mapping with -1 entries or a cache that is a strided view.
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or bool((slot_mapping < 0).any()):
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
