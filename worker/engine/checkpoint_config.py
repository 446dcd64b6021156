"""What the engine reads from a checkpoint's config: whether it is a causal language model with unquantized
weights, its dtype, its context and what sets it, its end-of-sequence ids, and the bytes of one KV-cache block."""

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


def architecture(config: PretrainedConfig) -> str:
    """The checkpoint's architecture as its config names it (else its model type), for messages."""
    return (getattr(config, "architectures", None) or [f"a {getattr(config, 'model_type', 'model')} model"])[0]


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def first_paragraph(error: BaseException) -> str:
    """An exception's first paragraph on one line: transformers' loading errors go on with advice (pip install,
    hub access) that does not apply to a local checkpoint."""
    return " ".join(str(error).strip().split("\n\n")[0].split())


def check_causal(config: PretrainedConfig) -> None:
    """Refuse a checkpoint saved with a head that does not predict the next token, naming it."""
    not_causal = ValueError(f"model: {architecture(config)} is not a causal language model; carpool generates with "
                            "checkpoints saved for next-token prediction (a ...ForCausalLM or ...LMHeadModel)")
    if getattr(config, "is_encoder_decoder", False):
        raise not_causal
    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith(NOT_GENERATIVE_HEADS):
            raise not_causal


def check_unquantized(config: PretrainedConfig) -> None:
    """Refuse a checkpoint whose weights were quantized before it was saved (FP8, GPTQ, AWQ, bitsandbytes, ...):
    their scales and packed integers are not weights carpool reads, and cast as if they were they give noise."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    raise ValueError(f"model: {architecture(config)}'s weights are pre-quantized (quantization_config.quant_method "
                     f"{str(method) if method is not None else 'unnamed'}); carpool loads unquantized checkpoints "
                     "(fp32, fp16 or bf16 weights) and quantizes them itself with --quantization int8|fp8")


# Where configs keep their context length: most, then GPT-2's and its kind's, MPT's, and a few others'.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def max_model_len(config: PretrainedConfig) -> tuple[int, str]:
    """The model's context length, and what sets it, for messages."""
    found = next(((name, value) for name in _CONTEXT_FIELDS
                  if isinstance(value := getattr(config, name, None), int) and value > 0), None)
    if found is None:
        raise ValueError(f"model: {architecture(config)}'s config names no context length "
                         f"({', '.join(_CONTEXT_FIELDS)}); carpool serves models whose context it knows")
    max_len, why = found[1], f"its {found[0]}"
    if rope_type(config) == "dynamic":
        # Dynamic NTK scaling exists to stretch the trained context by its factor.
        params = getattr(config, "rope_parameters", None) or {}
        max_len, why = int(max_len * float(params.get("factor", 1.0))), "its max_position_embeddings by its RoPE factor"
    window = getattr(config, "sliding_window", None)
    # The kernels attend to the whole context; within the window that equals sliding-window attention.
    if window and getattr(config, "use_sliding_window", True) and int(window) < max_len:
        max_len, why = int(window), "its sliding window: the context is served up to the window"
    return max_len, why


def eos_token_ids(model_path: str, config: PretrainedConfig, tokenizer_eos: int | None = None) -> set[int]:
    """The ids that end generation: the generation config's and the model config's; where neither names one, the
    tokenizer's EOS (a checkpoint whose configs were saved without it would otherwise never stop)."""
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
    if not ids and tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return ids
