"""The quantized matmul kernel (int8 / fp8 weights, per-row scales) against its reference, its plan, its start-up
check and its use by `linear`.

Without a GPU the kernel runs under Triton's interpreter (tests/harness/torch_setup.py sets it), which reads
int8 and float8_e4m3fn tensors alike, so both storage types are tested on CPU too.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import kernels.quantized_matmul as qm
from kernels.quantized_matmul import MAX_ROWS, MatmulPlan, plan_quantized_matmul, quantized_matmul
from kernels.quantized_matmul import quantized_matmul_reference as reference
from worker.engine.models import quantization as quantization_module
from worker.engine.models.quantization import Quantization, linear, quantize_weight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STORAGES = [torch.int8, torch.float8_e4m3fn]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the largest output. The kernel and the reference differ by fp32 summation order and the final
# rounding; Triton's CPU interpreter casts fp32 to bf16 by truncation, so there bf16 may be two units off.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3,
              torch.bfloat16: 8e-3 if torch.cuda.is_available() else 1.6e-2}
# The 1B model's layers (qkv, o, gate_up, down) as (out, in), and an H100's multiprocessors.
LAYER_SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
H100_MULTIPROCESSORS = 132


def _weight(n: int, k: int, storage: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if storage == torch.int8:
        data = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    else:
        data = (100 * torch.randn((n, k), generator=generator)).clamp(-448, 448).to(storage)
    scales = 1e-3 + 1e-2 * torch.rand(n, generator=generator)
    return data.to(DEVICE), scales.to(DEVICE)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn((m, k), generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tolerance = TOLERANCES[want.dtype]
    torch.testing.assert_close(got, want, atol=tolerance * want.float().abs().max().item(), rtol=tolerance)


def _small_plan(m: int, split_k: int, k: int) -> MatmulPlan:
    """16-wide blocks, so the irregular test shapes take several tiles, masked edges and `split_k` K ranges."""
    num_k_blocks = -(-k // 16)
    per_split = -(-num_k_blocks // split_k)
    assert -(-num_k_blocks // per_split) == split_k, (k, split_k)
    return MatmulPlan(block_m=max(16, 1 << (m - 1).bit_length()), block_n=16, block_k=16, split_k=split_k,
                      k_per_split=16 * per_split, num_warps=4, num_stages=1)


@pytest.mark.parametrize("storage", STORAGES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "split_k"), [(40, 72, 1), (40, 72, 3), (37, 33, 2)])
def test_kernel_matches_reference(storage: torch.dtype, dtype: torch.dtype, m: int, n: int, k: int,
                                  split_k: int) -> None:
    data, scales = _weight(n, k, storage, seed=n + k)
    scales = scales.to(dtype)
    x = _x(m, k, dtype, seed=m)
    _assert_close(quantized_matmul(x, data, scales, _small_plan(m, split_k, k)), reference(x, data, scales))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_unquantized_weight_is_the_plain_product(dtype: torch.dtype) -> None:
    """A weight in the activations' own dtype (the benchmark's baseline for the kernel) with scales of 1."""
    m, n, k = 3, 40, 72
    weight = (0.05 * torch.randn((n, k), generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    x = _x(m, k, dtype, seed=2)
    ones = torch.ones(n, dtype=dtype, device=DEVICE)
    _assert_close(quantized_matmul(x, weight, ones, _small_plan(m, 2, k)), reference(x, weight, ones))


@pytest.mark.parametrize("storage", STORAGES, ids=str)
def test_default_plan_and_strided_rows(storage: torch.dtype) -> None:
    """The planned launch (the GPU's own split, none on CPU) on x rows read out of a wider tensor."""
    data, scales = _weight(130, 96, storage, seed=3)
    wide = _x(MAX_ROWS, 100, torch.float32, seed=4)
    x = wide[:, 2:98]
    assert x.stride() == (100, 1)
    _assert_close(quantized_matmul(x, data, scales), reference(x, data, scales))
    assert quantized_matmul(x[:0], data, scales).shape == (0, 130)


@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 64])
@pytest.mark.parametrize(("n", "k"), LAYER_SHAPES)
def test_plan_covers_k_once_and_fills_the_gpu(m: int, n: int, k: int) -> None:
    plan = plan_quantized_matmul(m, n, k, H100_MULTIPROCESSORS)
    assert plan.block_m >= m, "every row in one row tile: the weight is read once"
    assert plan.k_per_split % plan.block_k == 0
    # The ranges cover K, and none starts past its end.
    assert plan.split_k * plan.k_per_split >= k > (plan.split_k - 1) * plan.k_per_split
    num_tiles = -(-n // plan.block_n)
    if num_tiles >= H100_MULTIPROCESSORS:
        assert plan.split_k == 1, "enough output tiles: no partial sums"
    elif m <= 8:
        assert num_tiles * plan.split_k >= H100_MULTIPROCESSORS, plan
    # The partial sums, written and read back in fp32, come to at most half the weight's bytes.
    if plan.split_k > 1:
        assert 2 * plan.split_k * m * n * 4 <= n * k // 2, plan
    assert plan_quantized_matmul(m, n, k, 0).split_k == 1, "no split off a GPU"


def test_start_up_check_accepts_the_kernel() -> None:
    from worker.engine.kernel_checks import check_quantized_matmul

    for storage in STORAGES:
        assert check_quantized_matmul(DEVICE, torch.float32, storage, [(40, 72), (24, 40)]) is None


def test_start_up_check_rejects_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine.kernel_checks import check_quantized_matmul

    def without_scales(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return reference(x, data, torch.ones_like(scales))

    # A storage type the kernel does not take fails its assertions: reported, not raised.
    failure = check_quantized_matmul(DEVICE, torch.float32, torch.float16, [(40, 72)])
    assert failure is not None and "AssertionError" in failure
    monkeypatch.setattr(qm, "quantized_matmul", without_scales)
    failure = check_quantized_matmul(DEVICE, torch.float32, torch.int8, [(40, 72)])
    assert failure == "the quantized matmul differs from its reference for [1, 72] x [40, 72]^T"


@pytest.mark.parametrize("quantization", list(Quantization), ids=lambda q: q.value)
def test_linear_takes_the_kernel_for_decode_sized_products(monkeypatch: pytest.MonkeyPatch,
                                                            quantization: Quantization) -> None:
    calls: list[int] = []

    def counted(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return quantized_matmul(x, data, scales)

    monkeypatch.setattr(quantization_module, "quantized_matmul", counted)
    generator = torch.Generator().manual_seed(5)
    weight = quantize_weight((0.3 * torch.randn(40, 72, generator=generator)).to(DEVICE), quantization, torch.float32)
    bias = torch.randn(40, generator=generator).to(DEVICE)
    for shape in [(2, 3, 72), (MAX_ROWS + 1, 72)]:
        x = torch.randn(shape, generator=generator).to(DEVICE)
        expected = F.linear(x, weight.dequantize(), bias)
        got = linear(x, weight, bias, use_kernel=True)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
    assert linear(x, weight, bias).shape == expected.shape
    assert calls == [6], "only the product of at most MAX_ROWS rows, and only when asked, runs the kernel"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the quantized kernel serves models on CUDA only")
def test_a_model_on_cuda_uses_the_kernel_unless_its_check_fails(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    cuda = torch.device("cuda")
    shapes = [(40, 72), (72, 40)]
    assert quantization_module.can_use_quantized_kernel(cuda, torch.bfloat16, Quantization.INT8, shapes)
    assert not quantization_module.can_use_quantized_kernel(torch.device("cpu"), torch.float32,
                                                            Quantization.INT8, shapes)
    monkeypatch.setattr(quantization_module, "check_quantized_matmul", lambda *args: "broken here")
    with caplog.at_level(logging.WARNING, logger=quantization_module.__name__):
        assert not quantization_module.can_use_quantized_kernel(cuda, torch.bfloat16, Quantization.INT8, shapes)
    assert "failed its start-up check (broken here)" in caplog.text
