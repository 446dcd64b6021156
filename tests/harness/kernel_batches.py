"""Random paged batches for the kernel tests: shuffled block tables over a shared cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Per-dtype tolerances against the fp32 torch reference: fp32 is exact up to
# summation order; fp16/bf16 lose a rounding of P before the P·V product and
# of the output itself.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# (query_len, context_len) mixes: decode, short and long chunks, a sequence
# that is all prompt, contexts that end mid-block and span several blocks.
MIXED_CASES = [(1, 1), (1, 17), (5, 18), (16, 33), (37, 100), (1, 300)]


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens, self.scale)


def make_batch(
    cases: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Each sequence gets its blocks from a shuffled pool; unused table entries stay 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(ctx / block_size) for _, ctx in cases]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(cases), max(blocks_per_seq) + 1), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = pool[used : used + n]
        used += n
    q_lens = torch.tensor([q_len for q_len, _ in cases])
    cu_seqlens_q = torch.zeros(len(cases) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = q_lens.cumsum(0)
    q = torch.randn((int(q_lens.sum()), num_heads, head_dim), generator=gen).to(dtype=dtype, device=device)
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        cu_seqlens_q=cu_seqlens_q.to(device),
        seq_lens=torch.tensor([ctx for _, ctx in cases], dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)
