"""Several engine-like steps through the Triton backend equal plain causal attention.

Two sequences grow step by step in a paged cache (one prefilled in chunks while
the other decodes), with blocks handed out in a shuffled order; every step's
output must equal SDPA over the same keys and values laid out contiguously.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from kernels import get_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 12


def _contiguous_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """SDPA over one sequence's whole history; `q` are its last positions."""
    q_len, seq_len = q.shape[0], keys.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)
    v = values.float().transpose(0, 1).repeat_interleave(group, dim=0)
    mask = torch.ones((q_len, seq_len), dtype=torch.bool).tril(diagonal=seq_len - q_len)
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def test_chunked_prefill_and_decode_steps_equal_contiguous_attention() -> None:
    backend = get_backend("triton")
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros(cache_shape, dtype=dtype, device=DEVICE)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables: list[list[int]] = [[], []]
    history_k: list[list[torch.Tensor]] = [[], []]
    history_v: list[list[torch.Tensor]] = [[], []]
    lengths = [0, 0]
    # Per step, new tokens of (sequence 0, sequence 1): 0 prefills 40 tokens in
    # chunks, then decodes, while 1 decodes after a 7-token prompt.
    steps = [(16, 7), (16, 1), (8, 1), (1, 1), (1, 1), (1, 1)]
    num_checked = 0
    for new_tokens in steps:
        q_parts, k_new, v_new, slots = [], [], [], []
        for s, n in enumerate(new_tokens):
            positions = range(lengths[s], lengths[s] + n)
            while len(tables[s]) * BLOCK_SIZE < lengths[s] + n:
                tables[s].append(free_blocks.pop())
            slots += [tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
            q_parts.append(torch.randn((n, NUM_HEADS, HEAD_DIM), generator=gen).to(dtype))
            k_new.append(torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=gen).to(dtype))
            v_new.append(torch.randn((n, NUM_KV_HEADS, HEAD_DIM), generator=gen).to(dtype))
            history_k[s].append(k_new[-1])
            history_v[s].append(v_new[-1])
            lengths[s] += n
        # A padding token (slot -1) whose garbage key must never land in the cache.
        pad = torch.full((1, NUM_KV_HEADS, HEAD_DIM), 1e4, dtype=dtype)
        backend.store_kv(
            torch.cat([*k_new, pad]).to(DEVICE),
            torch.cat([*v_new, pad]).to(DEVICE),
            k_cache,
            v_cache,
            torch.tensor([*slots, -1], device=DEVICE),
        )
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
        cu_seqlens_q = torch.tensor([0, new_tokens[0], sum(new_tokens)], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        q = torch.cat(q_parts).to(DEVICE)
        out = backend.attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, HEAD_DIM**-0.5)

        for s in range(2):
            start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            expected = _contiguous_attention(q_parts[s], torch.cat(history_k[s]), torch.cat(history_v[s]))
            torch.testing.assert_close(out[start:end].float().cpu(), expected, atol=2e-3, rtol=2e-3)
            num_checked += end - start
    assert lengths == [43, 12]
    assert num_checked == sum(a + b for a, b in steps)
    assert float(k_cache.abs().max()) < 1e3
