"""The model kernels (fused add + RMSNorm, SiLU-and-multiply, RoPE with the KV write) against their references.

Without a GPU they run under Triton's interpreter (tests/harness/torch_setup.py sets it).
"""

from __future__ import annotations

import pytest
import torch

from kernels.norm_act import add_rms_norm, add_rms_norm_reference, silu_and_mul, silu_and_mul_reference
from kernels.rope_kv import rope_store_kv, rope_store_kv_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernels round where the references do; what is left is fp32 summation order (the mean of squares)
# and, on a GPU, fused multiply-adds: a unit in the last place of the dtype. Triton's CPU interpreter casts
# fp32 to bf16 by truncation, not to nearest, so there bf16 results may be two units off.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3,
              torch.bfloat16: 8e-3 if torch.cuda.is_available() else 1.6e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 80, 200])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = _randn(7, hidden, dtype=dtype, seed=hidden)
    residual = _randn(7, hidden, dtype=dtype, seed=hidden + 1) if with_residual else None
    weight = _randn(hidden, dtype=dtype, seed=hidden + 2)
    out, total = add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_total = add_rms_norm_reference(x, residual, weight, 1e-6)
    # One rounded add: exact, but for bf16 under the CPU interpreter, whose casts to bf16 may round the
    # other way (a unit in the last place).
    exact = dtype != torch.bfloat16 or DEVICE.type == "cuda"
    tolerance = 0 if exact else TOLERANCES[dtype]
    torch.testing.assert_close(total, expected_total, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out, expected, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [32, 96, 1500])
def test_silu_and_mul(dtype: torch.dtype, width: int) -> None:
    gate_up = 3 * _randn(5, 2 * width, dtype=dtype, seed=width)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up),
                               atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (6, 1, 32), (4, 4, 80)])
def test_rope_store_kv(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    num_tokens, block_size, num_blocks = 6, 4, 5
    # q, k, v as views of one fused projection, as the model hands them over.
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    angles = _randn(num_tokens, head_dim // 2, dtype=torch.float32, seed=1) * 3
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    slots = torch.tensor([3, 17, -1, 0, 9, -1], device=DEVICE)  # -1: padding, written nowhere
    caches = [_randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (5, 6)]
    expected_caches = [c.clone() for c in caches]
    q_out = rope_store_kv(q, k, v, cos, sin, caches[0], caches[1], slots)
    expected = rope_store_kv_reference(q, k, v, cos, sin, expected_caches[0], expected_caches[1], slots)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(q_out, expected, atol=tolerance, rtol=tolerance)
    for got, want in zip(caches, expected_caches):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # the interpreter's, as intended
def test_start_up_checks_pass_for_working_kernels() -> None:
    from worker.engine.kernel_checks import check_model_kernels, check_paged_attention, check_sample_race

    assert check_paged_attention(DEVICE, torch.float32, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16) is None
    assert check_model_kernels(DEVICE, torch.float32, hidden=64, intermediate=96, num_heads=4, num_kv_heads=2,
                               head_dim=16) is None
    assert check_sample_race(DEVICE, vocab=3000) is None  # more than one block of the kernel's


def test_start_up_check_reports_a_kernel_that_cannot_run() -> None:
    from worker.engine.kernel_checks import check_model_kernels

    # An odd head_dim cannot be rotated in halves: the check says so instead of raising.
    failure = check_model_kernels(DEVICE, torch.float32, hidden=64, intermediate=96, num_heads=4, num_kv_heads=2,
                                  head_dim=15)
    assert failure is not None and "AssertionError" in failure
