"""What the engine reads from a checkpoint's config: whether it is a causal language model, its dtype, its
context and what sets it, its end-of-sequence ids, and the bytes of one KV-cache block."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PretrainedConfig

from worker.engine.graph_runner import rope_type

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
"""The names `--dtype` takes, and a config's stored dtype is read by."""


def kv_block_bytes(config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV-cache block of a model of `config` takes across all layers, keys and values."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * head_dim * element_size


def model_dtype(config: PretrainedConfig, dtype: str | None) -> torch.dtype:
    """The dtype asked for, or the checkpoint's (`auto` or None), as transformers reads it; fp32 when unset."""
    if dtype is None or dtype == "auto":
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, torch.dtype):
            return stored
        return DTYPES.get(str(stored).removeprefix("torch."), torch.float32) if stored else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}, expected one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


NOT_GENERATIVE_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                        "ForMultipleChoice", "ForNextSentencePrediction", "ForPreTraining")
"""Heads a checkpoint may be saved with that do not predict the next token: transformers would load such a
checkpoint's encoder under a causal head it was never trained with, and generate noise without a word."""


def check_causal(config: PretrainedConfig) -> None:
    """Refuse a checkpoint saved with a head that does not predict the next token, naming it."""
    is_encoder_decoder = getattr(config, "is_encoder_decoder", False)
    for arch in getattr(config, "architectures", None) or []:
        if is_encoder_decoder or arch.endswith(NOT_GENERATIVE_HEADS):
            raise ValueError(f"model: {arch} is not a causal language model; carpool generates with checkpoints "
                             "saved for next-token prediction (a ...ForCausalLM or ...LMHeadModel)")


def max_model_len(config: PretrainedConfig) -> tuple[int, str]:
    """The model's context length, and what sets it, for messages."""
    max_len, why = int(config.max_position_embeddings), "its max_position_embeddings"
    if rope_type(config) == "dynamic":
        # Dynamic NTK scaling exists to stretch the trained context by its factor.
        params = getattr(config, "rope_parameters", None) or {}
        max_len, why = int(max_len * float(params.get("factor", 1.0))), "its max_position_embeddings by its RoPE factor"
    window = getattr(config, "sliding_window", None)
    # The kernels attend to the whole context; within the window that equals sliding-window attention.
    if window and getattr(config, "use_sliding_window", True) and int(window) < max_len:
        max_len, why = int(window), "its sliding window: the context is served up to the window"
    return max_len, why


def eos_token_ids(model_path: str, config: PretrainedConfig) -> set[int]:
    """The ids that end generation: the generation config's and the model config's."""
    ids: set[int] = set()
    try:
        generation_config: GenerationConfig | None = GenerationConfig.from_pretrained(model_path, local_files_only=True)
    except OSError:
        generation_config = None
    for source in (generation_config, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids
