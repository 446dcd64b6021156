"""Paged attention and the KV store in batched plain torch: the CPU backend.

Same contract as `paged_attention_reference` (kernels/paged_attention.py),
which stays the test oracle. Where the reference gathers and attends one
sequence at a time, this gathers the blocks of many sequences with one index
op into a padded `[num_seqs, context, kv_heads, head_dim]` and runs one SDPA
over them with a length mask. Each prefill chunk is attended on its own, so a
long chunk never pads the decode rows up to its length; decode sequences
(one new token) are attended in groups of similar context length
(`plan_decode_groups`), so one long context does not pad every short one.

GQA costs no copies: as in the Triton kernel, the query rows of one kv head
are (token, head of its group) pairs, so each kv head's keys serve all the
query heads that share it.

The cache this backend allocates (`new_kv_cache`) keeps the layout every
backend indexes, `[num_blocks, block_size, kv_heads, head_dim]`, as a view
over storage laid out head-major, `[kv_heads, num_blocks, block_size,
head_dim]`. Gathering a sequence's blocks then yields each kv head's context
contiguous, which is the layout SDPA reads fastest on CPU; from the
token-major layout its reads stride across the heads. For the default model
on one core, with one engine per process, that made no difference at 8
sequences of 600-900 tokens; at 32 of 300-500, head-major steps were steady
where token-major ones took from the same time to 60 % longer
(bench/RESULTS.md). Every function here also takes a cache allocated
token-major.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.host_pages import zeros_on_huge_pages
from kernels.kv_store import store_kv_reference
from kernels.paged_attention_cpu import DecodePlan
from kernels.workspace import Workspace

# Python and launch cost of attending one more group, in bytes of fp32 keys and values gathered in the
# same time: about 70 us against 430 KiB for a tiny model on one CPU core. On a skewed decode mix of 8
# sequences, step times were flat from 256 KiB to 1 MiB; one group for all was 0.6 ms (10 %) slower per step.
GROUP_OVERHEAD_BYTES = 384 * 1024


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended together, padded to the longest context among them."""

    seqs: torch.Tensor
    """Sequence indices (int64, on the attention's device)."""
    max_seq_len: int
    blocks: torch.Tensor
    """`[len(seqs) * blocks of max_seq_len]` int64: each sequence's blocks, padded to the longest."""
    is_visible: torch.Tensor
    """`[len(seqs), 1, 1, context]` bool: the slots holding each sequence's context.

    Blocks and mask are the same for every layer, so they are built once per step.
    """


def plan_decode_groups(seq_indices: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
                       block_row_bytes: int) -> list[DecodeGroup]:
    """Split decode sequences into groups that minimise gathered bytes plus a per-group overhead.

    A group gathers `len(group) * its longest context` (in whole blocks of
    `block_row_bytes` for keys and values); each extra group costs
    `GROUP_OVERHEAD_BYTES`. Sequences with the same number of blocks always
    share a group; over the distinct block counts, sorted, the best split
    into runs is exact by dynamic programming (quadratic in the distinct
    counts, at most a few dozen). `seq_lens` are host copies of the
    sequences' context lengths; the groups' tensors live on `block_tables`'s device.
    """
    assert len(seq_indices) == len(seq_lens) and seq_indices
    by_blocks: dict[int, list[int]] = {}
    longest: dict[int, int] = {}
    for s, n in zip(seq_indices, seq_lens):
        blocks = -(-n // block_size)
        by_blocks.setdefault(blocks, []).append(s)
        longest[blocks] = max(longest.get(blocks, 0), n)
    levels = sorted(by_blocks, reverse=True)
    overhead = GROUP_OVERHEAD_BYTES / block_row_bytes
    # best[j]: cost of the first j levels; a run of levels i..j-1 pads to levels[i].
    best = [0.0] + [math.inf] * len(levels)
    run_start = [0] * (len(levels) + 1)
    for j in range(1, len(levels) + 1):
        rows = 0
        for i in range(j - 1, -1, -1):
            rows += len(by_blocks[levels[i]])
            cost = best[i] + overhead + rows * levels[i]
            if cost < best[j]:
                best[j], run_start[j] = cost, i
    length_of = dict(zip(seq_indices, seq_lens))
    groups = []
    j = len(levels)
    while j > 0:
        i = run_start[j]
        seqs = [s for level in levels[i:j] for s in by_blocks[level]]
        groups.append(_decode_group(seqs, [length_of[s] for s in seqs], levels[i], longest[levels[i]], block_tables,
                                    block_size))
        j = i
    groups.reverse()  # longest contexts first
    return groups


def _decode_group(seqs: list[int], seq_lens: list[int], num_blocks: int, max_seq_len: int,
                  block_tables: torch.Tensor, block_size: int) -> DecodeGroup:
    device = block_tables.device
    seqs_t = torch.tensor(seqs, dtype=torch.long, device=device)
    num_blocks = min(num_blocks, block_tables.shape[1])
    blocks = block_tables[seqs_t, :num_blocks].reshape(-1).long()
    slots = torch.arange(num_blocks * block_size, device=device)
    is_visible = slots[None, :] < torch.tensor(seq_lens, device=device)[:, None]
    return DecodeGroup(seqs_t, max_seq_len, blocks, is_visible[:, None, None, :])


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
    decode_groups: list[DecodeGroup] | None = None,
    workspace: Workspace | None = None,
    is_graphed: bool = False,
    cpu_decode: DecodePlan | None = None,
    **_launch_hints: int | None,
) -> torch.Tensor:
    """Batched paged attention; the keyword arguments are host hints that change no result.

    `max_query_len` spares a host read; `max_seq_len` is taken for the
    backends' common signature (groups and chunks know their own lengths).
    `decode_groups` (every sequence with one new token, grouped, as
    `plan_decode_groups` returns) spares planning them here, per layer, from
    host copies of the lengths; `workspace` keeps the gathered keys and
    values in buffers reused from call to call. A decode-only step given its
    groups reads nothing back to the host; a step with prefill chunks reads
    its query offsets and context lengths once. `is_graphed` marks a step
    recorded once and replayed, in which every sequence brings the same
    number of query rows (one for a decode, more for a speculative verify
    step): every sequence then attends over the block table's whole width,
    masked by its causal offsets on the device, so nothing is planned from
    host lengths. `cpu_decode` (the compiled CPU
    kernel of `paged_attention_cpu.py`, planned for this call's block tables,
    query offsets and lengths) attends every sequence of a few new tokens
    (decodes, speculative verification) in one call, reading the cache in
    place, when it accepts these tensors; `decode_groups` are then not
    needed, and only longer chunks go through SDPA.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape)
    assert q.shape[1] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    q = q.contiguous()  # rows are regrouped by views below
    block_size = k_cache.shape[1]
    if is_graphed:
        # Every sequence has q_len rows: row s * q_len + i is query i of sequence s, at position
        # seq_len - q_len + i. Rows that see nothing (padding) stay finite.
        q_len = q.shape[0] // num_seqs
        width = block_tables.shape[1]
        slots = torch.arange(width * block_size, device=q.device)
        q_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)
        is_visible = (slots[None, None, :] <= q_pos[:, :, None])[:, None]
        o = _attend(q.view(num_seqs, q_len, *q.shape[1:]), k_cache, v_cache, block_tables.reshape(-1).long(),
                    is_visible, scale, workspace)
        out.copy_(torch.nan_to_num(o.reshape(q.shape), nan=0.0).to(out.dtype))
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    # Sequences with at most this many new tokens are attended by the compiled kernel (0: none).
    attended_query_len = 0 if cpu_decode is None else cpu_decode.try_attend(q, k_cache, v_cache, scale, out)
    if attended_query_len:
        if max_query_len <= attended_query_len:
            return out
        decode_groups = []  # done: only the longer prefill chunks are left
    starts: list[int] = []
    if max_query_len > 1 or decode_groups is None:
        starts = cu_seqlens_q.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    if decode_groups is None:
        decodes = [s for s, n in enumerate(q_lens) if n == 1]
        block_row_bytes = 2 * k_cache[0].numel() * 4  # keys and values of one block, in fp32
        decode_groups = plan_decode_groups(decodes, seq_lens[decodes].tolist(), block_tables, block_size,
                                           block_row_bytes) if decodes else []
    for group in decode_groups:
        # In a decode-only step token row s is sequence s; otherwise sequence s's token sits at its offset.
        rows = group.seqs if max_query_len == 1 else cu_seqlens_q[:-1][group.seqs].long()
        o = _attend(q[rows].unsqueeze(1), k_cache, v_cache, group.blocks, group.is_visible, scale, workspace)
        out[rows] = o.squeeze(1).to(out.dtype)
    chunk_lens = seq_lens.tolist() if max_query_len > 1 else []
    for s, q_len in enumerate(q_lens):
        if q_len <= max(attended_query_len, 1):
            continue
        start, seq_len = starts[s], int(chunk_lens[s])
        # Only this sequence's own blocks: a short prompt beside a long context gathers a few, not the longest's.
        num_blocks = min(-(-seq_len // block_size), block_tables.shape[1])
        # Query i of the chunk sits at position seq_len - q_len + i and sees the keys up to it; that also
        # hides the gathered slots past the context, as every query sits inside it.
        k_pos = torch.arange(num_blocks * block_size, device=q.device)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        is_visible = (k_pos[None, :] <= q_pos[:, None])[None, None]
        o = _attend(q[start : start + q_len].unsqueeze(0), k_cache, v_cache, block_tables[s, :num_blocks].long(),
                    is_visible, scale, workspace)
        out[start : start + q_len] = o.squeeze(0).to(out.dtype)
    return out


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """A zeroed `[num_blocks, block_size, kv_heads, head_dim]` cache whose storage is head-major (on CPU, on
    huge pages where the OS grants them: `kernels/host_pages.py`)."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if device.type == "cpu":
        storage, _ = zeros_on_huge_pages(shape, dtype)
    else:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    return storage.permute(1, 2, 0, 3)


def _head_major(cache: torch.Tensor) -> torch.Tensor | None:
    """The storage of a `new_kv_cache` cache as `[kv_heads, num_blocks, block_size, d]`; None for another layout."""
    heads_first = cache.permute(2, 0, 1, 3)
    return heads_first if heads_first.is_contiguous() else None


def _write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Slot `slots[t]` of a token-major or head-major cache takes `new[t]` (`[tokens, kv_heads, d]`)."""
    heads_first = _head_major(cache)
    if heads_first is None:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.to(cache.dtype))
    else:
        flat = heads_first.reshape(cache.shape[2], -1, cache.shape[3])  # [kv_heads, slots, d], a view
        flat.index_copy_(1, slots, new.to(cache.dtype).transpose(0, 1))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, name: str, workspace: Workspace | None) -> torch.Tensor:
    """Keys or values of `blocks` in fp32 as `[kv_heads, len(blocks) * block_size, d]`, each head contiguous
    when the cache is head-major."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    heads_first = _head_major(cache)
    # index_select copies whole blocks at memcpy speed, where advanced indexing goes element by element.
    if heads_first is None:
        source, axis, shape = cache, 0, (blocks.shape[0], block_size, num_kv_heads, head_dim)
    else:
        source, axis, shape = heads_first, 1, (num_kv_heads, blocks.shape[0], block_size, head_dim)
    if workspace is None:
        gathered = source.index_select(axis, blocks).float()
    else:
        gathered = torch.index_select(source, axis, blocks, out=workspace.take(name, shape, cache.dtype, cache.device))
        if cache.dtype != torch.float32:
            gathered = workspace.take(name + "_fp32", shape, torch.float32, cache.device).copy_(gathered)
    if heads_first is None:
        return gathered.view(-1, num_kv_heads, head_dim).transpose(0, 1)
    return gathered.view(num_kv_heads, -1, head_dim)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    is_visible: torch.Tensor,
    scale: float,
    workspace: Workspace | None,
) -> torch.Tensor:
    """Attention of `q` `[n, q_len, heads, d]` over n paged contexts of `blocks` (`n * blocks each`, flat).

    `is_visible` `[n, 1, q_len, context]`: which gathered slots each query
    sees. Returns fp32 `[n, q_len, heads, d]`.
    """
    n, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    context = is_visible.shape[-1]
    # SDPA's batch axis is the kv head and its head axis the sequence: [kv_heads, n, context, d].
    keys = _gather(k_cache, blocks, "keys", workspace).view(num_kv_heads, n, context, head_dim)
    values = _gather(v_cache, blocks, "values", workspace).view(num_kv_heads, n, context, head_dim)
    # Rows of kv head h: (token i, head g of its group), token-major.
    rows = q.view(n, q_len, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    rows = rows.reshape(num_kv_heads, n, q_len * group, head_dim).float()
    # One query token's mask serves every head of its group: broadcast when there is one token.
    mask = is_visible if q_len == 1 else (
        is_visible[:, :, :, None, :].expand(n, 1, q_len, group, context).reshape(n, 1, q_len * group, context))
    o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask.transpose(0, 1), scale=scale)
    return o.view(num_kv_heads, n, q_len, group, head_dim).permute(1, 2, 0, 3, 4).reshape(n, q_len, num_heads, head_dim)


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `store_kv_reference`; one `index_copy_` per cache when no token is padding.

    The runner never pads, so the masked reference path only runs for a
    slot mapping with -1 entries or a cache that is another strided view
    than a token-major or head-major one.
    """
    dense = all(c.is_contiguous() or _head_major(c) is not None for c in (k_cache, v_cache))
    if not dense or bool((slot_mapping < 0).any()):
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    _write_slots(k_cache, slots, key)
    _write_slots(v_cache, slots, value)


def store_kv_torch_padded(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The store of a replayed step: reads nothing on the host, so it can be recorded once.

    Some of its rows are padding (slot -1). Padding rows write the first
    real row's key and value to that row's slot again: the same bytes, so
    the cache ends as if they wrote nothing. A step of padding alone (a
    graph's warm-up and recording, before any sequence holds a block)
    writes its first row, finite, to slot 0, as it has no real slot.
    """
    slots = slot_mapping.long()
    is_real = slots >= 0
    first = torch.argmax(is_real.to(torch.int8)).view(1)  # argmax takes the first of equal maxima
    slots = torch.where(is_real, slots, slots.index_select(0, first)).clamp_(min=0)
    rows = is_real[:, None, None]
    _write_slots(k_cache, slots, torch.where(rows, key, key.index_select(0, first)))
    _write_slots(v_cache, slots, torch.where(rows, value, value.index_select(0, first)))
