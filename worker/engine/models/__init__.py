"""The models a model runner can run: carpool's own for the Llama family, transformers' for the rest.

`load_causal_lm` picks the implementation by `config.architectures`
(`auto`), or as forced (`carpool`, `transformers`), and returns a callable
`model(input_ids [T], positions [T], metadata, logit_rows) -> logits`.
Weight quantization (`worker.engine.models.quantization`) covers both: carpool's
own models hold their fused layers quantized, and a transformers model has its
`nn.Linear` layers (all but the output projection) replaced by quantized ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from transformers import PretrainedConfig

from kernels.model_ops_cpu import CpuModelOps
from worker.engine.attention import METADATA_KWARG, PagedAttentionMetadata, register_paged_attention
from worker.engine.config import MODEL_IMPLS, ModelImpl, Quantization
from worker.engine.graph_runner import rope_type
from worker.engine.models.llama_family import ARCHITECTURES, LlamaFamilyModel, read_safetensors
from worker.engine.models.positional_rope import make_positional
from worker.engine.models.quantization import quantize_linear_layers, weights_outside_linear_layers
from worker.engine.models.rope import SUPPORTED_ROPE_TYPES

log = logging.getLogger(__name__)


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
                 logit_rows: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelChoice:
    impl: ModelImpl
    reason: str


def choose_model_impl(config: PretrainedConfig, requested: str, path: str | None = None) -> ModelChoice:
    """Which implementation runs `config`'s model, and why (for the start-up log); `path`, the checkpoint's
    directory, tells whether its weights are in a format carpool's own models read."""
    try:
        wanted = ModelImpl(requested)
    except ValueError:
        raise ValueError(f"model_impl: must be one of {', '.join(MODEL_IMPLS)}, got {requested!r}") from None
    arch = (getattr(config, "architectures", None) or ["unknown"])[0]
    misfit = _misfit(config, arch, path)
    if wanted is ModelImpl.TRANSFORMERS:
        return ModelChoice(ModelImpl.TRANSFORMERS, "asked for")
    if wanted is ModelImpl.CARPOOL:
        if misfit is not None:
            raise ValueError(f"model_impl: carpool's models cover {sorted(ARCHITECTURES)} with "
                             f"{sorted(SUPPORTED_ROPE_TYPES)} RoPE and SiLU; {misfit}")
        return ModelChoice(ModelImpl.CARPOOL, "asked for")
    if misfit is None:
        return ModelChoice(ModelImpl.CARPOOL, f"{arch} is in the Llama family")
    return ModelChoice(ModelImpl.TRANSFORMERS, f"not among carpool's own models: {misfit}")


def _misfit(config: PretrainedConfig, arch: str, path: str | None = None) -> str | None:
    """What keeps `config`'s model from carpool's own models, in a few words; None when nothing does."""
    if arch not in ARCHITECTURES:
        return f"this model is {arch}"
    if (rope := rope_type(config)) not in SUPPORTED_ROPE_TYPES:
        return f"this {arch} has {rope} RoPE"
    if (act := getattr(config, "hidden_act", "silu")) != "silu":
        return f"this {arch} uses {act}, not SiLU"
    if getattr(config, "mlp_bias", False):
        return f"this {arch} has MLP biases"
    rope_params = getattr(config, "rope_parameters", None) or {}
    if rope_params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        return f"this {arch} rotates part of each head (partial_rotary_factor)"
    if path is not None and Path(path).is_dir() and not any(Path(path).glob("*.safetensors")):
        return f"this {arch}'s weights are not in safetensors files"
    return None


class TransformersModel:
    """A transformers model with carpool's paged attention plugged in, behind the `CausalLM` call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
                 logit_rows: torch.Tensor | None) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            # A tensor of row indices: lm_head runs only on the rows sampled from (0 keeps every row).
            logits_to_keep=0 if logit_rows is None else logit_rows,
            **{METADATA_KWARG: metadata},
        )
        return output.logits[0]


def load_causal_lm(path: str, config: PretrainedConfig, impl: ModelImpl, dtype: torch.dtype,
                   device: torch.device, max_positions: int, use_kernels: bool | None = None,
                   quantization: Quantization | None = None, cpu_ops: CpuModelOps | None = None,
                   matmul_tuning: bool | None = None, matmul_cache: Path | None = None) -> CausalLM:
    """`use_kernels`: carpool's models use the fused Triton kernels, and quantized layers of either
    implementation the decode-sized matmul kernel on CUDA, each where it passes its start-up check (default: on
    CUDA); `quantization`: how their linear weights are held (None: in `dtype`); `cpu_ops`: the same fusions
    compiled for the CPU, for carpool's models in fp32 on CPU; `matmul_tuning`: carpool's models time their
    decode-sized products at load and keep the fastest launch for each (default: where the kernels run), the
    choices kept in a file in the `matmul_cache` folder."""
    if impl is ModelImpl.CARPOOL:
        return LlamaFamilyModel(config, read_safetensors(path), dtype, device, max_positions, use_kernels,
                                quantization, cpu_ops, matmul_tuning, matmul_cache)
    from transformers import AutoModelForCausalLM  # seconds to import: only for this path (see attention.py)

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                 attn_implementation=register_paged_attention())
    # transformers declares PreTrainedModel.to through functools.wraps, and typeshed's `_Wrapped` binds no
    # `self`, so mypy takes the device for the model.
    model.to(device).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    # Frequencies that follow the call's largest position would follow the batch's: each token's own instead.
    make_positional(model)
    wants_kernels = device.type == "cuda" if use_kernels is None else use_kernels
    if quantization is not None:
        left = weights_outside_linear_layers(model)  # before the linear layers' weights turn into buffers
        total = sum(parameter.numel() for parameter in model.parameters())
        if quantize_linear_layers(model, quantization, wants_kernels) == 0:
            raise ValueError(f"quantization: {type(model).__name__} has no torch.nn.Linear layers to hold as "
                             f"{quantization.value}")
        if left:
            log.warning("quantization: %s holds %.0f%% of its weights outside torch.nn.Linear layers (%s), which stay "
                        "in %s, not %s", type(model).__name__, 100 * sum(left.values()) / max(total, 1),
                        ", ".join(sorted(left, key=left.__getitem__, reverse=True)), str(dtype).removeprefix("torch."),
                        quantization.value)
    return TransformersModel(model)
