"""Writing a step's new keys and values into the paged KV cache.

Slot `s` of a cache is block `s // block_size`, offset `s % block_size`;
slot -1 marks a padding token whose key and value are dropped. One file
holds the Triton kernel, its wrapper and the plain-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpret import check_launchable


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: all of its kv heads at once.
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # The slot is loaded once per head row: a per-row vector keeps every mask a
    # full 2-D tile (the interpreter rejects scalar-and-tile masks).
    slot = tl.load(slot_mapping_ptr + token + offs_h * 0).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # Padding tokens (slot -1) are masked out; BLOCK_H / BLOCK_D are padded to
    # powers of two, so their tails are masked too.
    mask = (slot[:, None] >= 0) & (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    # Gather this token's [heads, head_dim] key and value rows.
    key = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    # Scatter into the cache slot; block ids go through int64 so large caches do not overflow.
    k_dst = k_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None]
    v_dst = v_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None]
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        key.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton store: writes `key[t]`, `value[t]` into cache slot `slot_mapping[t]` (skips -1)."""
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, cache_heads, cache_dim = k_cache.shape
    assert (num_kv_heads, head_dim) == (cache_heads, cache_dim), (key.shape, k_cache.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert not slot_mapping.is_floating_point(), slot_mapping.dtype
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    assert len(devices) == 1, devices
    check_launchable(key.device, _store_kv_kernel)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch store: `k_cache[slot // B, slot % B] = key[t]` for every slot >= 0."""
    block_size = k_cache.shape[1]
    is_kept = slot_mapping >= 0
    slots = slot_mapping[is_kept].long()
    k_cache[slots // block_size, slots % block_size] = key[is_kept].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[is_kept].to(v_cache.dtype)
