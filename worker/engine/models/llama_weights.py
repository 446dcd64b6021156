"""The tensors a Llama-family checkpoint holds, and the shape of each, as its config implies them.

Checked before anything is fused: a tensor whose shape the config does not imply (a config field missing, and
so taken at its default; weights from another model) is refused in one line naming the tensor and the config
fields, where it would fail deep in a kernel, or be read as something else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class _Expected:
    shape: tuple[int, ...]
    fields: str
    """The config fields that imply the shape, with their values, for messages."""
    is_required: bool = True


def check_weights(config: PretrainedConfig, weights: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                  head_dim: int) -> None:
    """Refuse `weights` (names without the `model.` prefix) when one the model reads is missing or has a shape
    other than `config` implies; unknown tensors are left to the loader."""
    for name, expected in _expected_shapes(config, num_heads, num_kv_heads, head_dim).items():
        tensor = weights.get(name)
        if tensor is None:
            if expected.is_required:
                raise ValueError(f"model: the checkpoint has no {name}, which its config implies ({expected.fields})")
            continue
        if tuple(tensor.shape) != expected.shape:
            raise ValueError(f"model: {name} has shape {list(tensor.shape)} where the config implies "
                             f"{list(expected.shape)} ({expected.fields})")


def _expected_shapes(config: PretrainedConfig, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> dict[str, _Expected]:
    hidden, intermediate, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    h = f"hidden_size {hidden}"
    q = f"num_attention_heads {num_heads} x head_dim {head_dim}"
    kv = f"num_key_value_heads {num_kv_heads} x head_dim {head_dim}"
    i = f"intermediate_size {intermediate}"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shapes = {
        "embed_tokens.weight": _Expected((vocab, hidden), f"vocab_size {vocab}, {h}"),
        "norm.weight": _Expected((hidden,), h),
        "lm_head.weight": _Expected((vocab, hidden), f"vocab_size {vocab}, {h}; tie_word_embeddings "
                                    f"{str(tied).lower()}", is_required=not tied),
    }
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
        attn, mlp = p + "self_attn.", p + "mlp."
        shapes |= {
            attn + "q_proj.weight": _Expected((q_rows, hidden), f"{q}, {h}"),
            attn + "k_proj.weight": _Expected((kv_rows, hidden), f"{kv}, {h}"),
            attn + "v_proj.weight": _Expected((kv_rows, hidden), f"{kv}, {h}"),
            attn + "o_proj.weight": _Expected((hidden, q_rows), f"{h}, {q}"),
            attn + "q_proj.bias": _Expected((q_rows,), q, is_required=False),
            attn + "k_proj.bias": _Expected((kv_rows,), kv, is_required=False),
            attn + "v_proj.bias": _Expected((kv_rows,), kv, is_required=False),
            attn + "o_proj.bias": _Expected((hidden,), h, is_required=False),
            attn + "q_norm.weight": _Expected((head_dim,), f"head_dim {head_dim}", is_required=False),
            attn + "k_norm.weight": _Expected((head_dim,), f"head_dim {head_dim}", is_required=False),
            mlp + "gate_proj.weight": _Expected((intermediate, hidden), f"{i}, {h}"),
            mlp + "up_proj.weight": _Expected((intermediate, hidden), f"{i}, {h}"),
            mlp + "down_proj.weight": _Expected((hidden, intermediate), f"{h}, {i}"),
            p + "input_layernorm.weight": _Expected((hidden,), h),
            p + "post_attention_layernorm.weight": _Expected((hidden,), h),
        }
    return shapes
