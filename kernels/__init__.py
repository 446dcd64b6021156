"""Attention backends over the paged KV cache.

`get_backend("torch")` is batched plain torch (the CPU default; its
per-sequence reference in `paged_attention.py` is the test oracle);
`get_backend("triton")` runs the Triton kernels (CUDA, or CPU tensors
under `TRITON_INTERPRET=1`). Importing this package launches nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.kv_store import store_kv
from kernels.paged_attention import paged_attention
from kernels.paged_attention_torch import new_kv_cache, paged_attention_torch, store_kv_torch, store_kv_torch_padded

StoreKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
Attention = Callable[..., torch.Tensor]
NewCache = Callable[[int, int, int, int, torch.dtype, torch.device], torch.Tensor]


def new_token_major_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    return torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)


@dataclass(frozen=True)
class AttentionBackend:
    """The two calls a model runner needs per layer: store this step's KV, then attend."""

    name: str
    store_kv: StoreKV
    attention: Attention
    store_kv_padded: StoreKV
    """The store a recorded (graph) step uses: padding rows (slot -1) among the real ones must leave the cache as
    it was, with no host reads."""
    new_cache: NewCache
    """A zeroed cache of one layer's keys or values, `(num_blocks, block_size, kv_heads, head_dim, dtype, device)`:
    `[num_blocks, block_size, kv_heads, head_dim]` for every backend, over the storage layout its attention reads
    fastest."""


BACKEND_NAMES = ("torch", "triton")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return AttentionBackend("torch", store_kv_torch, paged_attention_torch, store_kv_torch_padded, new_kv_cache)
    if name == "triton":
        # The Triton store masks slot -1 itself.
        return AttentionBackend("triton", store_kv, paged_attention, store_kv, new_token_major_cache)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")


__all__ = ["AttentionBackend", "BACKEND_NAMES", "get_backend"]
