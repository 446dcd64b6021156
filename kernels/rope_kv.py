"""RoPE applied where the KV cache is written: Triton kernel, wrapper, torch reference.

One program per token rotates its query heads into `q_out`, rotates its key
heads and writes them with its value heads into the cache slot
`slot_mapping[token]` (-1: padding, the cache is left alone). It replaces
two RoPE passes and the KV store. Rounding follows transformers'
`q * cos + rotate_half(q) * sin` in the model's dtype: each product and the
sum are rounded as theirs are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpret import check_launchable
from kernels.kv_store import store_kv_reference


@triton.jit
def _rotate_half_tile(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    # out[:half] = x1*c1 - x2*s1, out[half:] = x2*c2 + x1*s2, each product and sum rounded to DTYPE.
    out1 = ((x1 * c1).to(DTYPE).to(tl.float32) + (-x2 * s1).to(DTYPE).to(tl.float32)).to(DTYPE)
    out2 = ((x2 * c2).to(DTYPE).to(tl.float32) + (x1 * s2).to(DTYPE).to(tl.float32)).to(DTYPE)
    return out1, out2


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_HALF)
    is_d = offs_d < HALF
    # This token's cos/sin halves, in fp32.
    c1 = tl.load(cos_ptr + token * stride_ct + offs_d, mask=is_d, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + token * stride_ct + HALF + offs_d, mask=is_d, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + token * stride_st + offs_d, mask=is_d, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + token * stride_st + HALF + offs_d, mask=is_d, other=0.0).to(tl.float32)[None, :]

    # Query heads: rotate into q_out.
    offs_h = tl.arange(0, BLOCK_H)
    q_mask = (offs_h[:, None] < NUM_HEADS) & is_d[None, :]
    q_row = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh
    q1 = tl.load(q_row + offs_d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + HALF + offs_d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half_tile(q1, q2, c1, c2, s1, s2, dtype)
    qo_row = q_out_ptr + token * stride_qot + offs_h[:, None] * stride_qoh
    tl.store(qo_row + offs_d[None, :], o1, mask=q_mask)
    tl.store(qo_row + HALF + offs_d[None, :], o2, mask=q_mask)

    # Key heads: rotate, then write with the values into the token's cache slot (skipped for -1).
    offs_kv = tl.arange(0, BLOCK_KV)
    slot = tl.load(slot_mapping_ptr + token + offs_kv * 0).to(tl.int64)
    kv_mask = (slot[:, None] >= 0) & (offs_kv[:, None] < NUM_KV_HEADS) & is_d[None, :]
    k_row = k_ptr + token * stride_kt + offs_kv[:, None] * stride_kh
    k1 = tl.load(k_row + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_row + HALF + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate_half_tile(k1, k2, c1, c2, s1, s2, dtype)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kc_row = k_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None] + offs_kv[:, None] * stride_kch
    tl.store(kc_row + offs_d[None, :], r1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc_row + HALF + offs_d[None, :], r2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_row = v_ptr + token * stride_vt + offs_kv[:, None] * stride_vh
    vc_row = v_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None] + offs_kv[:, None] * stride_vch
    for half in tl.static_range(2):
        v = tl.load(v_row + half * HALF + offs_d[None, :], mask=kv_mask, other=0.0)
        tl.store(vc_row + half * HALF + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotated queries `[tokens, heads, head_dim]` (a new tensor); rotated keys and values written to the cache.

    q, k, v may be strided views with a contiguous head_dim; cos and sin are `[tokens, head_dim]`.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert head_dim % 2 == 0 and cache_dim == head_dim, (q.shape, k_cache.shape)
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (k.shape, v.shape)
    assert cos.shape == sin.shape == (num_tokens, head_dim), (cos.shape, sin.shape)
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    for t in (q, k, v, cos, sin, k_cache, v_cache):
        assert t.stride(-1) == 1, t.stride()
    check_launchable(q.device, _rope_store_kv_kernel)
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens:
        _rope_store_kv_kernel[(num_tokens,)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, BLOCK_SIZE=block_size,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return q_out


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` for `[tokens, heads, head_dim]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_store_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    store_kv_reference(apply_rope_reference(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return apply_rope_reference(q, cos, sin)
