"""Weight-only quantization of linear layers: int8 or fp8 (e4m3) weights, one scale per output channel.

carpool's own models hold their fused layers' weights this way; a model that runs through transformers has
each of its `nn.Linear` layers but the output projection replaced by a `QuantizedLinear` at load.

A layer's weight is a `LinearWeight`: a plain tensor, a `QuantizedWeight`,
or an fp32 weight packed for CPU (`worker.engine.models.packed`), and
`linear(x, weight, bias)` is `F.linear` for each, so the model's call sites
read as before. Quantization is symmetric per output
row: `scale = max|w_row| / QMAX`, `w ≈ data * scale`, with the scale held in
the model's dtype and rounded to it before the row is quantized, so
`dequantize()` gives exactly the weights the products use. Activations, the
KV cache and the logits stay in the model's dtype.

The product is `(x @ data^T) * scale`: the stored values are exact in bf16,
fp16 and fp32, so the only roundings added are those of the scale multiply.
On CUDA, a product of at most `MAX_ROWS` rows (a decode step's) runs the
Triton kernel of `kernels/decode_matmul.py` when the model gives `linear`
its `MatmulChoices` (once `can_use_quantized_kernel` has checked the kernel
on the model's shapes at start-up): it reads the weight in its storage type,
once, and accumulates in fp32. The same choices can send a plain weight's
decode-sized products to that kernel too, where timing at start-up found it
faster than torch's (`worker.engine.models.matmul_choice`). On CPU with bf16/fp16 activations an int8
weight whose rows are a multiple of 16 long goes through
`torch._weight_int8pack_mm` (a vectorized int8 kernel). Elsewhere (more
rows, where the product is compute-bound, or the kernel off) the weight is
widened to the activations' dtype for the matmul (torch's own int8 kernel
is a scalar loop on CPU for fp32, and fp32-only and untiled on CUDA). See
docs/internals.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.decode_matmul import decode_matmul
from kernels.split_kv import num_multiprocessors
from worker.engine.config import QUANTIZATIONS, Quantization
from worker.engine.kernel_checks import check_quantized_matmul
from worker.engine.models.matmul_choice import MatmulChoices
from worker.engine.models.packed import PackedWeight, packed_linear

log = logging.getLogger(__name__)

# The largest magnitude each storage type holds; a row's largest weight maps onto it.
_STORAGE: dict[Quantization, tuple[torch.dtype, float]] = {
    Quantization.INT8: (torch.int8, 127.0),
    Quantization.FP8: (torch.float8_e4m3fn, 448.0),
}
# fp8 storage needs compute capability 8.9 (Ada) or later on CUDA.
FP8_MIN_CAPABILITY = (8, 9)
_INT8_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# torch's CPU int8 kernel reads whole vectors along a row: a row length that is not a multiple of this gives
# garbage or a crash (torch 2.13), so such matrices take the widening path.
_INT8_KERNEL_ROW_MULTIPLE = 16


def parse_quantization(name: str | None) -> Quantization | None:
    if name is None:
        return None
    try:
        return Quantization(name)
    except ValueError:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)} or unset, got {name!r}") from None


def check_device_supports(quantization: Quantization | None, device: torch.device,
                          capability: tuple[int, int] | None = None) -> None:
    """Refuse fp8 weights on a CUDA device older than Ada; `capability` defaults to the device's own."""
    if quantization is not Quantization.FP8 or device.type != "cuda":
        return
    found = capability if capability is not None else torch.cuda.get_device_capability(device)
    if tuple(found) < FP8_MIN_CAPABILITY:
        raise ValueError(f"quantization: fp8 weights need a GPU with fp8 support (compute capability "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or later); {device} has "
                         f"{found[0]}.{found[1]}; use --quantization int8")


@dataclass(frozen=True)
class QuantizedWeight:
    """A `[out, in]` weight as `data` (int8 or float8_e4m3fn) times the per-row `scales` `[out]`."""

    data: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the products use, in `dtype` (the test reference)."""
        return (self.data.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(dtype)


LinearWeight = torch.Tensor | QuantizedWeight | PackedWeight


def quantize_weight(weight: torch.Tensor, quantization: Quantization, dtype: torch.dtype) -> QuantizedWeight:
    """Per-output-row symmetric quantization of `weight` `[out, in]`, scales in `dtype`, on `weight`'s device."""
    assert weight.dim() == 2, f"a linear weight is 2-D, got {tuple(weight.shape)}"
    storage, qmax = _STORAGE[quantization]
    rows = weight.to(torch.float32)
    # Each scale is max|row| / qmax rounded up in `dtype` (one step up, then to nearest), so that the row's
    # largest weight is not clipped; the smallest step is `dtype`'s smallest subnormal, which also keeps an
    # all-zero row's scale from zero (zeros, not NaN). fp16's smallest normal number (6e-5) as the floor would
    # give rows of small weights a scale far too large, and them only a few of the 255 levels.
    info = torch.finfo(dtype)
    smallest = info.tiny * info.eps
    scales = (rows.abs().amax(dim=1) / qmax * (1 + info.eps) + smallest).to(dtype)
    scaled = (rows / scales.to(torch.float32)[:, None]).clamp(-qmax, qmax)
    data = scaled.round().to(storage) if storage == torch.int8 else scaled.to(storage)
    return QuantizedWeight(data.contiguous(), scales.contiguous())


def can_use_quantized_kernel(device: torch.device, dtype: torch.dtype, quantization: Quantization,
                             shapes: Iterable[tuple[int, int]]) -> bool:
    """Whether `linear(..., matmuls)` may send quantized weights to the kernel for a model on `device`: on CUDA, when the Triton kernel gives
    its reference's results for weights of each `(out, in)` shape; a failure is logged, and the weights are then
    widened for each product instead."""
    if device.type != "cuda":
        return False
    failure = check_quantized_matmul(device, dtype, _STORAGE[quantization][0], sorted(set(shapes)))
    if failure is not None:
        log.warning("the quantized matmul kernel failed its start-up check (%s); quantized weights are widened "
                    "for each product instead", failure)
        return False
    return True


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None,
           matmuls: MatmulChoices | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a plain, packed or quantized weight; the result is in `x`'s dtype.

    `matmuls`: on the GPU, which products of at most `MAX_ROWS` rows run the Triton kernel, and how (None: none
    do; the caller has checked the kernel with `can_use_quantized_kernel` where its weights are quantized)."""
    if isinstance(weight, torch.Tensor):
        if matmuls is not None:
            flat = x.reshape(-1, x.shape[-1])
            plan = matmuls.plan(flat.shape[0], weight, quantized=False)
            if plan is not None:
                return decode_matmul(flat, weight, None, plan, bias=bias).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if isinstance(weight, PackedWeight):
        return packed_linear(x, weight, bias)
    return _quantized_product(x, weight, matmuls, bias)


def gated_linear(gate_up: torch.Tensor, weight: LinearWeight, matmuls: MatmulChoices) -> torch.Tensor | None:
    """`linear(silu_and_mul(gate_up), weight)` in one launch of the kernel, reading the activation in, where
    `matmuls` holds a gated plan for these rows (an MLP's down projection); None where it does not."""
    if isinstance(weight, PackedWeight):
        return None
    data, scales = (weight.data, weight.scales) if isinstance(weight, QuantizedWeight) else (weight, None)
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    plan = matmuls.gated_plan(flat.shape[0], data)
    if plan is None:
        return None
    return decode_matmul(flat, data, scales, plan, gated=True).view(*gate_up.shape[:-1], data.shape[0])


def _quantized_product(x: torch.Tensor, weight: QuantizedWeight, matmuls: MatmulChoices | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    plan = matmuls.plan(flat.shape[0], weight.data, quantized=True) if matmuls is not None else None
    if plan is not None:
        # The bias added to the fp32 sum inside the kernel, before its one rounding.
        return decode_matmul(flat, weight.data, weight.scales, plan, bias=bias).view(*x.shape[:-1], weight.shape[0])
    if (weight.data.dtype == torch.int8 and x.device.type == "cpu" and x.dtype in _INT8_KERNEL_DTYPES
            and weight.shape[1] % _INT8_KERNEL_ROW_MULTIPLE == 0):
        out = torch._weight_int8pack_mm(flat.contiguous(), weight.data, weight.scales).view(
            *x.shape[:-1], weight.shape[0])
    else:
        out = F.linear(x, weight.data.to(x.dtype)) * weight.scales
    return out if bias is None else out + bias


class QuantizedLinear(torch.nn.Module):
    """A `torch.nn.Linear` whose weight is held quantized, for models carpool runs through transformers:
    the same storage and product as carpool's own layers (`quantize_weight`, `linear`)."""

    weight_data: torch.Tensor
    weight_scales: torch.Tensor

    def __init__(self, layer: torch.nn.Linear, quantization: Quantization,
                 matmuls: MatmulChoices | None = None) -> None:
        super().__init__()
        weight = quantize_weight(layer.weight.detach(), quantization, layer.weight.dtype)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.matmuls = matmuls
        self.register_buffer("weight_data", weight.data)
        self.register_buffer("weight_scales", weight.scales)
        self.bias = layer.bias

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.weight_data, self.weight_scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.matmuls)


def weights_outside_linear_layers(model: torch.nn.Module) -> dict[str, int]:
    """The matrices (and larger tensors) of `model` that are neither an `nn.Linear`'s nor an `nn.Embedding`'s,
    by the module class and name that hold them (the layer index left out), with their element counts summed:
    what `quantize_linear_layers` leaves in the model's dtype (fused MoE experts, GPT-2's `Conv1D`, ...)."""
    found: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() >= 2 and parameter.is_floating_point():
                key = f"{type(module).__name__}.{name}"
                found[key] = found.get(key, 0) + parameter.numel()
    return found


def quantize_linear_layers(model: torch.nn.Module, quantization: Quantization, use_kernels: bool = False) -> int:
    """Replace every `nn.Linear` of `model` but its output projection (the logits stay in the model's dtype) by a
    `QuantizedLinear`, in place; returns how many were replaced. `use_kernels`: their decode-sized products run
    the Triton kernel where `can_use_quantized_kernel` passes it on the layers' shapes."""
    output_of = getattr(model, "get_output_embeddings", None)
    output = output_of() if callable(output_of) else None
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and module is not output]
    use_kernel = use_kernels and bool(targets) and can_use_quantized_kernel(
        targets[0][1].weight.device, targets[0][1].weight.dtype, quantization,
        [(module.out_features, module.in_features) for _, module in targets])
    # Each bucket's default plan: a transformers model's products are not timed.
    matmuls = MatmulChoices(num_multiprocessors(targets[0][1].weight.device)) if use_kernel else None
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedLinear(module, quantization, matmuls))
    return len(targets)
