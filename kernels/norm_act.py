"""Fused residual-add + RMSNorm, and SiLU-and-multiply: Triton kernels, wrappers, torch references.

Both round where transformers' modules round (the sum to the model's dtype
before the norm, the normalised row before the weight, SiLU before the
product), so a model using them gives transformers' numbers; the arithmetic
between roundings is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.dependent_launch import gdc_launch_dependents, launches_dependents
from kernels.interpret import check_launchable


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        # The matrix product after this kernel may start and fetch its weight (`kernels/dependent_launch.py`).
        gdc_launch_dependents()
    # One program per row.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the model's dtype, as `residual + x` is, and kept as the next residual.
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    # Mean of squares in fp32, then the row scaled and rounded before the weight multiplies it.
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for `[rows, hidden]`; without a residual, of x alone."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    assert weight.shape == (x.shape[1],) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    check_launchable(x.device, _add_rms_norm_kernel)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out, residual_out, eps,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), residual_out.stride(0),
            HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), HAS_RESIDUAL=residual is not None,
            LAUNCH_DEPENDENTS=launches_dependents(x.device),
        )
    return out, residual_out


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' arithmetic: `residual + x` in the model's dtype, normalised in fp32, then the weight."""
    total = x if residual is None else residual + x
    x32 = total.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(total.dtype), total


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid: (row, column tile). The row holds gate then up, WIDTH each.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + offs, mask=mask, other=0.0).to(tl.float32)
    # SiLU in fp32, rounded to the dtype as torch's silu is, then the product rounded.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for `[rows, 2 * width]` holding gate then up; returns `[rows, width]`."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(-1) == 1, gate_up.shape
    check_launchable(gate_up.device, _silu_and_mul_kernel)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=block)
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
