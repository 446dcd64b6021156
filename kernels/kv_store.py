"""Writing a step's new keys and values into the paged KV cache.

Slot `s` of a cache is block `s // block_size`, offset `s % block_size`;
slot -1 marks a padding token whose key and value are dropped.
"""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch store: `k_cache.view(-1, H, D)[slot] = key[t]` for every slot >= 0."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    is_kept = slot_mapping >= 0
    slots = slot_mapping[is_kept].long()
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat[slots] = key[is_kept].to(k_cache.dtype)
    v_flat[slots] = value[is_kept].to(v_cache.dtype)
