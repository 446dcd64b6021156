"""fp32 weights pre-packed for oneDNN's matrix product on CPU: carpool's own models, at load.

`F.linear` on CPU hands an fp32 product to MKL's GEMM, which re-lays the
weight into its blocked format on every call; with a few rows, as in a
decode step, that re-layout costs as much as the product. Packing the
weight once into oneDNN's layout (`torch.ops.mkldnn._reorder_linear_weight`,
the op torch's compiler uses when it freezes a CPU model) and multiplying
with `_linear_pointwise` made a 1B model's matrices 1.5-3x faster at 2 to
8 rows, timed alone on one core of an AVX-512 CPU (bench/RESULTS.md). The
default model's 17 products got 1.6x faster at 8 rows timed alone, but its
11.6 MB of weights stay in the CPU's cache during a whole step, where MKL's
re-layout is cheap: there the gain was within noise at 8 rows.
One-row products, though, are
slower through oneDNN: its call costs about 12 us more than MKL's, most of
a one-row product by a small matrix, and in whole steps of an 87M-parameter
model at batch 1 the packed weights cost 15 % more. So each packed weight
keeps its plain copy for one-row products: on CPU in fp32 the own model
holds its matrices twice, which the start-up log states.

Both are private torch ops, so each packed weight is checked at load against
`F.linear` on a few rows: if the ops are missing or give another product
(beyond fp32 rounding), the model keeps that weight and the rest plain and
the start-up log says why. Only fp32 weights on CPU are packed: bf16 and fp16 already go
to oneDNN through `F.linear`, and CUDA has its own GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Relative to the largest value of the product: packed and plain differ by the order of fp32 sums only.
_TOLERANCE = 1e-4


@dataclass(frozen=True)
class PackedWeight:
    """A `[out, in]` fp32 weight in oneDNN's blocked layout (opaque: only `packed_linear` reads it)."""

    data: torch.Tensor
    plain: torch.Tensor
    """The weight as it was, for one-row products."""
    shape: torch.Size
    nbytes: int


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    assert weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu", (
        weight.shape, weight.dtype, weight.device)
    plain = weight.contiguous()
    # No batch-size hint: one layout serves every number of rows a step has.
    data = torch.ops.mkldnn._reorder_linear_weight(plain, None)
    return PackedWeight(data, plain, weight.shape, 2 * weight.nbytes)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the packed weight."""
    if x.numel() == x.shape[-1]:
        return F.linear(x, weight.plain, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight.data, bias, "none", [], "")


def pack_verified(weight: torch.Tensor) -> PackedWeight | str:
    """`weight` packed, once its product of a few rows matched `F.linear`'s; otherwise why it cannot be used."""
    # Three rows: more than one, so the product goes through the packed weight, not the plain copy.
    rows = torch.randn((3, weight.shape[1]), generator=torch.Generator().manual_seed(0))
    try:
        packed = pack_weight(weight)
        got = packed_linear(rows, packed)
    except (RuntimeError, AttributeError) as error:  # a torch build without the ops, or one that refuses a shape
        return f"{type(error).__name__}: {error}"
    want = F.linear(rows, weight)
    scale = float(want.abs().max()) or 1.0
    if got.shape != want.shape or not float((got - want).abs().max()) <= _TOLERANCE * scale:
        return f"the packed product of a [{weight.shape[0]}, {weight.shape[1]}] weight differs from F.linear's"
    return packed
