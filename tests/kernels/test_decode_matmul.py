"""The decode-sized matmul kernel (plain weights, and int8 / fp8 weights with per-row scales) against its
reference, its plans, its start-up check, the timed choice between its plans and torch's product, and its use
by `linear`.

Without a GPU the kernel runs under Triton's interpreter (tests/harness/torch_setup.py sets it), which reads
int8 and float8_e4m3fn tensors alike, so both storage types are tested on CPU too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

import kernels.decode_matmul as qm
from kernels.decode_matmul import MAX_ROWS, MatmulPlan, candidate_plans, decode_matmul, plan_decode_matmul
from kernels.decode_matmul import decode_matmul_reference as reference
from kernels.dependent_launch import launches_dependents
from kernels.split_kv import num_multiprocessors
from worker.engine.models import quantization as quantization_module
from worker.engine.models.matmul_choice import (
    ROW_BUCKETS,
    MatmulChoices,
    cache_file,
    choose_matmuls,
    kind_of,
    row_bucket,
)
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


def _small_plan(m: int, split_k: int, k: int, tma: bool = False) -> MatmulPlan:
    """16-wide blocks, so the irregular test shapes take several tiles, masked edges and `split_k` K ranges."""
    num_k_blocks = -(-k // 16)
    per_split = -(-num_k_blocks // split_k)
    assert -(-num_k_blocks // per_split) == split_k, (k, split_k)
    return MatmulPlan(block_m=max(16, 1 << (m - 1).bit_length()), block_n=16, block_k=16, split_k=split_k,
                      k_per_split=16 * per_split, num_warps=4, num_stages=1, tma=tma)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split_k", [1, 3])
def test_a_bias_is_added_before_the_one_rounding(dtype: torch.dtype, split_k: int) -> None:
    """A bias (Qwen2's q/k/v) added to the fp32 sum, after the scales, in the kernel or in the reduction of its
    K ranges: one rounding, as torch's product with a bias rounds."""
    m, n, k = 3, 40, 72
    generator = torch.Generator().manual_seed(17)
    bias = torch.randn(n, generator=generator).to(dtype).to(DEVICE)
    weight = (0.05 * torch.randn((n, k), generator=generator)).to(dtype).to(DEVICE)
    x = _x(m, k, dtype, seed=18)
    plan = _small_plan(m, split_k, k)
    got = decode_matmul(x, weight, None, plan, bias=bias)
    _assert_close(got, reference(x, weight, None, bias=bias))
    torch.testing.assert_close(reference(x, weight, None, bias=bias).float(),
                               (F.linear(x.float(), weight.float()) + bias.float()).to(dtype).float())
    data, scales = _weight(n, k, torch.int8, seed=19)
    _assert_close(decode_matmul(x, data, scales.to(dtype), plan, bias=bias),
                  reference(x, data, scales.to(dtype), bias=bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k", "split_k", "tma"), [(3, 40, 64, 2, False), (5, 24, 72, 3, False),
                                                            (3, 40, 64, 1, True)])
def test_the_gated_product_reads_silu_and_mul_in(dtype: torch.dtype, m: int, n: int, k: int, split_k: int,
                                                  tma: bool) -> None:
    """An MLP's down projection with its activation read in: the product of `silu_and_mul(gate_up)`, the same
    as the activation's own kernel followed by the plain product, on plain and quantized weights."""
    from kernels.norm_act import silu_and_mul

    gate_up = _x(m, 2 * k, dtype, seed=m + k)
    weight = (0.05 * torch.randn((n, k), generator=torch.Generator().manual_seed(3))).to(dtype).to(DEVICE)
    plan = _small_plan(m, split_k, k, tma)
    fused = decode_matmul(gate_up, weight, None, plan, gated=True)
    _assert_close(fused, reference(gate_up, weight, None, gated=True))
    torch.testing.assert_close(fused, decode_matmul(silu_and_mul(gate_up), weight, None, plan), rtol=0, atol=0)
    data, scales = _weight(n, k, torch.int8, seed=4)
    _assert_close(decode_matmul(gate_up, data, scales.to(dtype), plan, gated=True),
                  reference(gate_up, data, scales.to(dtype), gated=True))


@pytest.mark.parametrize("storage", STORAGES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(3, 40, 96, 2), (17, 37, 80, 3)])
def test_a_quantized_weight_through_its_descriptor(storage: torch.dtype, dtype: torch.dtype, m: int, n: int, k: int,
                                                   split_k: int) -> None:
    """The weight read through a tensor descriptor (zeros past N and K), rows of a whole number of 16 bytes."""
    data, scales = _weight(n, k, storage, seed=n + k)
    x = _x(m, k, dtype, seed=m)
    plan = _small_plan(m, split_k, k, tma=True)
    _assert_close(decode_matmul(x, data, scales.to(dtype), plan), reference(x, data, scales.to(dtype)))


@pytest.mark.parametrize("storage", STORAGES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k", "split_k"), [(40, 72, 1), (40, 72, 3), (37, 33, 2)])
def test_kernel_matches_reference(storage: torch.dtype, dtype: torch.dtype, m: int, n: int, k: int,
                                  split_k: int) -> None:
    data, scales = _weight(n, k, storage, seed=n + k)
    scales = scales.to(dtype)
    x = _x(m, k, dtype, seed=m)
    _assert_close(decode_matmul(x, data, scales, _small_plan(m, split_k, k)), reference(x, data, scales))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(3, 40, 64, 1), (3, 40, 64, 2), (5, 40, 80, 2), (17, 37, 72, 3)])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_a_plain_weight_is_the_plain_product(dtype: torch.dtype, m: int, n: int, k: int, split_k: int,
                                             tma: bool) -> None:
    """A weight in the activations' own dtype without scales: K a whole number of blocks (unmasked loads),
    split into ranges of equal length and with a shorter last one, and K not a whole number of blocks (masked);
    rows and columns past the tiles' edges."""
    weight = (0.05 * torch.randn((n, k), generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    x = _x(m, k, dtype, seed=2)
    plan = _small_plan(m, split_k, k, tma)
    _assert_close(decode_matmul(x, weight, None, plan), reference(x, weight))
    torch.testing.assert_close(reference(x, weight).float(), F.linear(x.float(), weight.float()).to(dtype).float())


@pytest.mark.parametrize("storage", STORAGES, ids=str)
def test_default_plan_and_strided_rows(storage: torch.dtype) -> None:
    """The planned launch (the GPU's own split, none on CPU) on x rows read out of a wider tensor."""
    data, scales = _weight(130, 96, storage, seed=3)
    wide = _x(MAX_ROWS, 100, torch.float32, seed=4)
    x = wide[:, 2:98]
    assert x.stride() == (100, 1)
    _assert_close(decode_matmul(x, data, scales), reference(x, data, scales))
    assert decode_matmul(x[:0], data, scales).shape == (0, 130)


def _assert_covers(plan: MatmulPlan, m: int, k: int) -> None:
    assert plan.block_m >= m, "every row in one row tile: the weight is read once"
    assert plan.k_per_split % plan.block_k == 0
    # The ranges cover K, and none starts past its end.
    assert plan.split_k * plan.k_per_split >= k > (plan.split_k - 1) * plan.k_per_split, plan


@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 64])
@pytest.mark.parametrize(("n", "k"), LAYER_SHAPES)
def test_plan_covers_k_once_and_fills_the_gpu(m: int, n: int, k: int) -> None:
    for plan in [plan_decode_matmul(m, n, k, H100_MULTIPROCESSORS), *candidate_plans(m, n, k, H100_MULTIPROCESSORS)]:
        _assert_covers(plan, m, k)
    plan = plan_decode_matmul(m, n, k, H100_MULTIPROCESSORS)
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
    assert plan_decode_matmul(m, n, k, 0).split_k == 1, "no split off a GPU"


def test_start_up_check_accepts_the_kernel() -> None:
    from worker.engine.kernel_checks import check_quantized_matmul

    for storage in STORAGES:
        assert check_quantized_matmul(DEVICE, torch.float32, storage, [(40, 72), (24, 40)]) is None


def test_start_up_check_rejects_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine.kernel_checks import check_quantized_matmul

    def without_scales(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                       plan: MatmulPlan | None = None) -> torch.Tensor:
        return reference(x, data, None)

    # A storage type the kernel does not take fails its assertions: reported, not raised.
    failure = check_quantized_matmul(DEVICE, torch.float32, torch.float16, [(40, 72)])
    assert failure is not None and "AssertionError" in failure
    monkeypatch.setattr(qm, "decode_matmul", without_scales)
    failure = check_quantized_matmul(DEVICE, torch.float32, torch.int8, [(40, 72)])
    assert failure == "the quantized matmul differs from its reference for [1, 72] x [40, 72]^T"


@pytest.mark.parametrize("quantization", list(Quantization), ids=lambda q: q.value)
def test_linear_takes_the_kernel_for_decode_sized_products(monkeypatch: pytest.MonkeyPatch,
                                                            quantization: Quantization) -> None:
    calls: list[int] = []

    def counted(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, plan: MatmulPlan,
                gated: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return decode_matmul(x, data, scales, plan, gated, bias)

    monkeypatch.setattr(quantization_module, "decode_matmul", counted)
    generator = torch.Generator().manual_seed(5)
    weight = quantize_weight((0.3 * torch.randn(40, 72, generator=generator)).to(DEVICE), quantization, torch.float32)
    bias = torch.randn(40, generator=generator).to(DEVICE)
    for shape in [(2, 3, 72), (MAX_ROWS + 1, 72)]:
        x = torch.randn(shape, generator=generator).to(DEVICE)
        expected = F.linear(x, weight.dequantize(), bias)
        got = linear(x, weight, bias, MatmulChoices(num_multiprocessors=0))
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


@pytest.mark.parametrize(("n", "k"), LAYER_SHAPES)
def test_candidate_plans_start_with_the_default_and_differ(n: int, k: int) -> None:
    for m in ROW_BUCKETS:
        plans = candidate_plans(m, n, k, H100_MULTIPROCESSORS, 2)
        assert plans[0] == plan_decode_matmul(m, n, k, H100_MULTIPROCESSORS)
        assert len(set(plans)) == len(plans) > 1
        assert {p.block_m for p in plans} == {plans[0].block_m}, "one row block per row count"
        with_tma = candidate_plans(m, n, k, H100_MULTIPROCESSORS, 2, with_tma=True)
        assert not any(p.tma for p in plans) and with_tma[:len(plans)] == plans
        # Each block shape and split again through TMA (the default plan among them where it is one of those).
        assert {dataclasses.replace(p, tma=False) for p in with_tma if p.tma} in ({*plans}, {*plans[1:]})
    assert not any(p.tma for p in candidate_plans(8, 40, 36, H100_MULTIPROCESSORS, 2, with_tma=True)), \
        "72-byte rows: not a whole number of 16 bytes"


def test_choices_take_the_bucket_of_the_rows() -> None:
    plain = torch.zeros((40, 72))
    quantized = torch.zeros((40, 72), dtype=torch.int8)
    plan = _small_plan(20, 2, 72)
    choices = MatmulChoices(num_multiprocessors=0, plans={(24, kind_of(plain)): plan, (32, kind_of(plain)): None})
    assert [row_bucket(r) for r in (1, 3, 8, 9, 17, 24, 25, 64)] == [1, 4, 8, 16, 24, 24, 32, 64]
    # Every row count of a bucket takes its plan: a padded graph and an eager step launch alike.
    assert choices.plan(17, plain, quantized=False) is plan and choices.plan(24, plain, quantized=False) is plan
    assert choices.plan(30, plain, quantized=False) is None, "torch's product was the faster there"
    assert choices.plan(8, plain, quantized=False) is None, "not timed: torch's product for a plain weight"
    assert choices.plan(8, quantized, quantized=True) == plan_decode_matmul(8, 40, 72, 0), "a quantized one's default"
    assert choices.plan(MAX_ROWS + 1, quantized, quantized=True) is None, "more rows than the kernel takes"
    assert choices.plan(0, plain, quantized=False) is None


def test_the_timed_choice_keeps_the_fastest_by_a_margin(caplog: pytest.LogCaptureFixture) -> None:
    """The choice between torch's product and the kernel's plans, with a timer that charges by plan: torch's
    product stays unless a plan is clearly faster, a plan that cannot launch is left out, and each kept plan
    gave the reference's results on the model's own matrices (run here under the interpreter)."""
    generator = torch.Generator().manual_seed(6)
    matrices: list[tuple[torch.Tensor, torch.Tensor | None]] = [
        (torch.randn((40, 64), generator=generator).to(DEVICE), None) for _ in range(2)]
    quantized: list[tuple[torch.Tensor, torch.Tensor | None]] = [_weight(24, 64, torch.int8, seed=7)]
    groups = {kind_of(matrices[0][0]): matrices, kind_of(quantized[0][0]): quantized}
    timed: list[object] = []

    def timer(call: object) -> float:
        plan = call.args[2]  # type: ignore[attr-defined]  # partial(_products, x, matrices, plan)
        timed.append(plan)
        if plan is not None and plan.block_n == 128:
            raise OutOfResources(300_000, 232_448, "shared memory")
        if plan is None:
            return 10.0
        if plan.block_k == 256 and plan.block_n == 32:
            return 8.0 if call.args[0].shape[0] == 1 else 9.8  # type: ignore[attr-defined]
        return 9.9

    with caplog.at_level(logging.INFO):
        choices = choose_matmuls(groups, torch.float32, DEVICE, 0, timer, buckets=(1, 24))
    plain_kind, quantized_kind = kind_of(matrices[0][0]), kind_of(quantized[0][0])
    one_row = choices.plans[(1, plain_kind)]
    assert one_row is not None and (one_row.block_n, one_row.block_k) == (32, 256), "20 % faster: the kernel"
    assert choices.plans[(24, plain_kind)] is None, "2 % faster is within the noise: torch's product stays"
    assert choices.plans[(24, quantized_kind)] is not None, "a quantized weight always takes one of the plans"
    assert None not in [p for (_, kind), p in choices.plans.items() if kind == quantized_kind]
    assert timed.count(None) == 2, "torch's product timed for the plain kind at each bucket, never the quantized"
    assert "cannot run here (OutOfResources: out of resource: shared memory" in caplog.text
    assert "1 rows: 16x32x256 blocks" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the choice is timed with CUDA graphs")
def test_the_timed_choice_runs_on_the_gpu() -> None:
    """Timed by CUDA graphs on the GPU itself: a choice for every bucket of each kind, each kept plan checked."""
    cuda = torch.device("cuda")
    generator = torch.Generator(device=cuda).manual_seed(8)
    weights = [(0.02 * torch.randn((1024, 512), generator=generator, device=cuda)).to(torch.bfloat16)
               for _ in range(3)]
    matrices: list[tuple[torch.Tensor, torch.Tensor | None]] = [(w, None) for w in weights]
    choices = choose_matmuls({kind_of(weights[0]): matrices}, torch.bfloat16, cuda, num_multiprocessors(cuda))
    assert set(choices.plans) == {(bucket, kind_of(weights[0])) for bucket in ROW_BUCKETS}
    x = torch.randn((24, 512), generator=generator, device=cuda).to(torch.bfloat16)
    _assert_close(linear(x, weights[0], None, choices), reference(x, weights[0]))


def test_a_quantized_kind_without_a_plan_widens_and_a_device_failure_ends_the_timing() -> None:
    quantized: list[tuple[torch.Tensor, torch.Tensor | None]] = [_weight(24, 64, torch.int8, seed=9)]
    kind = kind_of(quantized[0][0])

    def unfit(call: object) -> float:
        raise OutOfResources(300_000, 232_448, "shared memory")

    choices = choose_matmuls({kind: quantized}, torch.float32, DEVICE, 0, unfit, buckets=(8,))
    assert choices.plans == {(8, kind): None}
    assert choices.plan(5, quantized[0][0], quantized=True) is None, "widened for torch's product"
    weight = quantize_weight(torch.randn((24, 64), generator=torch.Generator().manual_seed(9)).to(DEVICE),
                             Quantization.INT8, torch.float32)
    x = _x(5, 64, torch.float32, seed=10)
    torch.testing.assert_close(linear(x, weight, None, choices), F.linear(x, weight.dequantize()))

    class DeviceLost(Exception):
        pass

    def broken(call: object) -> float:
        raise DeviceLost("the device fell off the bus")

    # (A CUDA error is a RuntimeError, as Triton's backend failures are: on a GPU the timing tells them apart
    # by synchronizing, which raises again for the device's.)
    with pytest.raises(DeviceLost, match="fell off the bus"):
        choose_matmuls({kind: quantized}, torch.float32, DEVICE, 0, broken, buckets=(8,))


def test_the_choices_are_kept_for_the_next_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A second start on the same GPU model reads the choices back instead of timing them again; a kind it has
    not met is timed and added; a file it cannot read is timed over and rewritten."""
    generator = torch.Generator().manual_seed(11)
    plain: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((40, 64), generator=generator).to(DEVICE),
                                                               None)]
    other: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((24, 64), generator=generator).to(DEVICE),
                                                               None)]
    path = cache_file(tmp_path, DEVICE, torch.float32, 0)
    assert path.parent == tmp_path and path.suffix == ".json"
    assert cache_file(tmp_path, DEVICE, torch.float16, 0) != path, "one file per activation dtype"

    def plans_faster(call: object) -> float:
        plan = call.args[2]  # type: ignore[attr-defined]
        return 10.0 if plan is None else 5.0 + plan.split_k

    first = choose_matmuls({kind_of(plain[0][0]): plain}, torch.float32, DEVICE, 0, plans_faster, (1, 8), path)
    assert all(plan is not None for plan in first.plans.values())

    def untimed(call: object) -> float:
        raise AssertionError("timed again")

    again = choose_matmuls({kind_of(plain[0][0]): plain}, torch.float32, DEVICE, 0, untimed, (1, 8), path)
    assert again.plans == first.plans
    both = choose_matmuls({kind_of(plain[0][0]): plain, kind_of(other[0][0]): other}, torch.float32, DEVICE, 0,
                          lambda call: 10.0 if call.args[2] is None else 20.0,  # type: ignore[attr-defined]
                          (1, 8), path)
    assert {key: plan for key, plan in both.plans.items() if key[1] == kind_of(plain[0][0])} == first.plans
    assert both.plans[(8, kind_of(other[0][0]))] is None, "torch's product, timed faster, is kept too"
    assert choose_matmuls({kind_of(other[0][0]): other}, torch.float32, DEVICE, 0, untimed, (1, 8), path).plans == {
        key: plan for key, plan in both.plans.items() if key[1] == kind_of(other[0][0])}
    for garbage in ["{not json", '{"40x64:float32:1": {"block_m": -1}}', "[]"]:
        path.write_text(garbage)
        with caplog.at_level(logging.WARNING):
            redone = choose_matmuls({kind_of(plain[0][0]): plain}, torch.float32, DEVICE, 0, plans_faster, (1, 8),
                                    path)
        assert "not readable" in caplog.text and redone.plans == first.plans
        caplog.clear()
    assert choose_matmuls({kind_of(plain[0][0]): plain}, torch.float32, DEVICE, 0, untimed, (1, 8), path).plans == \
        first.plans, "rewritten whole"
    # Well formed but not for these rows (edited by hand, say): timed again rather than launched.
    path.write_text(path.read_text().replace('"block_m": 16', '"block_m": 4', 1))
    with caplog.at_level(logging.WARNING):
        assert choose_matmuls({kind_of(plain[0][0]): plain}, torch.float32, DEVICE, 0, plans_faster, (1, 8),
                              path).plans == first.plans
    assert "does not fit" in caplog.text


def test_a_near_tie_keeps_the_first_plan_and_an_unwritable_folder_only_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    generator = torch.Generator().manual_seed(12)
    plain: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((40, 64), generator=generator).to(DEVICE),
                                                               None)]
    default = plan_decode_matmul(8, 40, 64, 0)

    def near_tie(call: object) -> float:
        plan = call.args[2]  # type: ignore[attr-defined]
        return 10.0 if plan is None else 5.1 if plan == default else 5.0

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be
    with caplog.at_level(logging.WARNING):
        choices = choose_matmuls({kind_of(plain[0][0]): plain}, torch.float32, DEVICE, 0, near_tie, (8,),
                                 blocked / "choices.json")
    assert choices.plans[(8, kind_of(plain[0][0]))] == default, "2 % slower than the fastest: the first in order"
    assert "cannot keep the matmul choices" in caplog.text


def test_a_kept_tma_launch_is_timed_again_where_the_gpu_has_no_tma(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    generator = torch.Generator().manual_seed(13)
    plain: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((40, 64), generator=generator).to(DEVICE),
                                                               None)]
    kind = kind_of(plain[0][0])
    path = tmp_path / "choices.json"

    def tma_faster(call: object) -> float:
        plan = call.args[2]  # type: ignore[attr-defined]
        return 10.0 if plan is None else 4.0 if plan.tma else 6.0

    chosen = choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, tma_faster, (8,), path, with_tma=True)
    plan = chosen.plans[(8, kind)]
    assert plan is not None and plan.tma
    assert '"tma": true' in path.read_text()
    assert choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, tma_faster, (8,), path,
                          with_tma=True).plans == chosen.plans, "read back as it was"
    with caplog.at_level(logging.WARNING):
        again = choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, tma_faster, (8,), path, with_tma=False)
    assert "does not fit" in caplog.text
    replan = again.plans[(8, kind)]
    assert replan is not None and not replan.tma


def test_a_kept_dependent_launch_is_timed_again_where_the_device_has_none(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A dependent launch kept by a worker on a Hopper GPU is never launched where programmatic dependent launch
    is missing (here, off CUDA): the file's choice is timed again; a plan without the field is not read."""
    generator = torch.Generator().manual_seed(15)
    plain: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((40, 64), generator=generator).to(DEVICE),
                                                               None)]
    kind = kind_of(plain[0][0])
    path = tmp_path / "choices.json"

    def plans_faster(call: object) -> float:
        plan = call.args[2]  # type: ignore[attr-defined]
        assert plan is None or not plan.dependent or launches_dependents(DEVICE), "a dependent launch timed here"
        return 10.0 if plan is None else 5.0 + plan.split_k

    first = choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, plans_faster, (8,), path)
    chosen = first.plans[(8, kind)]
    assert chosen is not None and '"dependent": false' in path.read_text()
    if launches_dependents(DEVICE):
        pytest.skip("this GPU launches dependents: a kept dependent launch fits it")
    path.write_text(path.read_text().replace('"dependent": false', '"dependent": true'))
    with caplog.at_level(logging.WARNING):
        again = choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, plans_faster, (8,), path)
    assert "does not fit" in caplog.text and again.plans == first.plans
    caplog.clear()
    path.write_text(re.sub(r',\s*"dependent": false', "", path.read_text()))
    with caplog.at_level(logging.WARNING):
        assert choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, plans_faster, (8,), path).plans == first.plans
    assert "not readable" in caplog.text


@pytest.mark.skipif(not launches_dependents(DEVICE), reason="programmatic dependent launch: a Hopper GPU or later")
@pytest.mark.parametrize(("n", "k", "split_k"), [(2560, 2048, 6), (2048, 5632, 9), (1000, 2000, 1), (40, 36, 3)])
def test_a_dependent_launch_gives_the_same_bits(n: int, k: int, split_k: int) -> None:
    """Started while the kernels before it end, the product is bit for bit the ordinary launch's, split or not,
    eagerly and replayed from a CUDA graph after the fused norm and another dependent product whose result it
    reads."""
    from kernels.norm_act import add_rms_norm

    generator = torch.Generator(device=DEVICE).manual_seed(n + k)
    weight = (0.02 * torch.randn((n, k), generator=generator, device=DEVICE)).to(torch.bfloat16)
    square = (0.02 * torch.randn((k, n), generator=generator, device=DEVICE)).to(torch.bfloat16)
    x = torch.randn((24, k), generator=generator, device=DEVICE).to(torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(k, generator=generator, device=DEVICE).to(torch.bfloat16)
    block_k = 128 if k % 128 == 0 else 16
    num_k_blocks = -(-k // block_k)
    per_split = -(-num_k_blocks // split_k)
    plan = MatmulPlan(block_m=32, block_n=64, block_k=block_k, split_k=-(-num_k_blocks // per_split),
                      k_per_split=block_k * per_split, num_warps=4, num_stages=3)
    back = plan_decode_matmul(24, k, n, num_multiprocessors(DEVICE))

    def chain(dependent: bool) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _ = add_rms_norm(x, residual, norm_weight, 1e-6)
        out = decode_matmul(normed, weight, None, dataclasses.replace(plan, dependent=dependent))
        return out, decode_matmul(out, square, None, dataclasses.replace(back, dependent=dependent))

    want = chain(False)
    _assert_close(want[0], reference(add_rms_norm(x, residual, norm_weight, 1e-6)[0], weight))
    torch.testing.assert_close(chain(True), want, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = chain(True)
    x.copy_(torch.randn(x.shape, generator=generator, device=DEVICE).to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(recorded, chain(False), rtol=0, atol=0)


def test_a_down_projection_reads_its_activation_in_where_that_is_faster(tmp_path: Path) -> None:
    """The gated choice: among the plain product's fastest plans, read the activation in where that beats the
    activation's own kernel and the plain choice by the margin; kept in the file beside the plain choices."""
    generator = torch.Generator().manual_seed(14)
    down: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((40, 64), generator=generator).to(DEVICE),
                                                              None) for _ in range(2)]
    kind = kind_of(down[0][0])
    calls: list[str] = []

    def timer(call: object) -> float:
        function, args = call.func, call.args  # type: ignore[attr-defined]
        gated = len(args) > 3 and args[3]
        calls.append(function.__name__ + (" gated" if gated else ""))
        if function.__name__ == "each_activation_then_product":
            return 10.0
        if args[2] is None:
            return 8.0  # torch's plain product
        return 6.0 if gated and args[0].shape[0] == 1 else 9.9 if gated else 7.0

    path = tmp_path / "choices.json"
    choices = choose_matmuls({kind: down}, torch.float32, DEVICE, 0, timer, (1, 8), path, gated_kinds={kind})
    assert choices.plans[(1, kind)] is not None and choices.plans[(8, kind)] is not None, "7 against torch's 8"
    gated_one_row = choices.gated_plan(1, down[0][0])
    assert gated_one_row is not None, "6 against 10: read in"
    assert choices.gated_plan(8, down[0][0]) is None, "9.9 against 10: the activation's own kernel stays"
    assert choices.gated_plan(MAX_ROWS + 1, down[0][0]) is None
    assert calls.count("each_activation_then_product") == 2
    assert 0 < calls.count("each_product gated") <= 2 * 3, "only the plain product's fastest few are tried"
    assert '"40x64:float32:1:gated"' in path.read_text()

    def untimed(call: object) -> float:
        raise AssertionError("timed again")

    again = choose_matmuls({kind: down}, torch.float32, DEVICE, 0, untimed, (1, 8), path, gated_kinds={kind})
    assert again == choices
    assert any("SiLU-and-multiply read in: 1 rows" in line for line in choices.describe())


def test_the_file_as_another_worker_left_it_wins_and_odd_files_are_timed_over(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    generator = torch.Generator().manual_seed(15)
    plain: list[tuple[torch.Tensor, torch.Tensor | None]] = [(torch.randn((40, 64), generator=generator).to(DEVICE),
                                                               None)]
    quantized: list[tuple[torch.Tensor, torch.Tensor | None]] = [_weight(24, 64, torch.int8, seed=16)]
    kind, quantized_kind = kind_of(plain[0][0]), kind_of(quantized[0][0])
    path = tmp_path / "choices.json"
    theirs = candidate_plans(8, 40, 64, 0)[-1]

    def racing(call: object) -> float:
        # Another worker finishes first and keeps its own choice for the plain kind.
        if not path.exists():
            path.write_text(json.dumps({"40x64:float32:8": dataclasses.asdict(theirs)}))
        return 10.0 if call.args[2] is None else 5.0  # type: ignore[attr-defined]

    def unfit(call: object) -> float:
        if call.args[2] is None:  # type: ignore[attr-defined]
            return 10.0
        raise OutOfResources(300_000, 232_448, "shared memory")

    ours = choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, racing, (8,), path)
    assert ours.plans[(8, kind)] == theirs, "the file's choice, not this worker's own timing"
    both = choose_matmuls({kind: plain, quantized_kind: quantized}, torch.float32, DEVICE, 0, unfit, (8,), path)
    assert both.plans[(8, quantized_kind)] is None
    assert "24x64:int8" not in path.read_text(), "a quantized kind no plan served is timed again next time"
    # Hand-edited or foreign: a plan the kernel was not planned for, bytes that are not text, deep nesting.
    for content in [json.dumps({"40x64:float32:8": {**dataclasses.asdict(theirs), "num_warps": 3}}).encode(),
                    b"\xff\xfe{", b"[" * 100_000]:
        path.write_bytes(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            redone = choose_matmuls({kind: plain}, torch.float32, DEVICE, 0, racing, (8,), path)
        assert "does not fit" in caplog.text or "not readable" in caplog.text
        assert redone.plans[(8, kind)] is not None
