"""Rotary position embeddings for carpool's own models, from the config as transformers reads it.

The inverse frequencies and the attention factor come from transformers' own
functions for each RoPE type (default, linear, llama3, yarn, dynamic), so a
position gets the same cos/sin as in transformers. Static types read one
precomputed table by position. `dynamic` (NTK) scales each token's
frequencies for its own position, `pos + 1`, on the device: what
transformers does for a decode step, without a host read. A prompt longer
than the original context is thereby scaled per position, where transformers
scales a whole forward for its longest position.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.rope_kv import apply_rope_reference as apply_rope
from worker.engine.graph_runner import rope_type

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
SUPPORTED_ROPE_TYPES = STATIC_ROPE_TYPES | {"dynamic"}


def _default_inv_freq(config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


class RotaryEmbedding:
    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.kind = rope_type(config)
        if self.kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope: carpool's models do not implement {self.kind!r} RoPE")
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope: carpool's models rotate the whole head (no partial_rotary_factor)")
        self.config = config
        self.dtype = dtype
        if self.kind == "default":
            inv_freq, scaling = _default_inv_freq(config, head_dim), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.kind](config, torch.device("cpu"))
        self.attention_scaling = float(scaling)
        self.inv_freq = inv_freq.to(device)
        if self.kind in STATIC_ROPE_TYPES:
            positions = torch.arange(max_positions, device=device)
            self.cos, self.sin = self._cos_sin(positions, self.inv_freq)

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The same arithmetic as transformers' rotary modules: fp32 frequencies, then the model's dtype.
        freqs = positions[:, None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(self.dtype), (emb.sin() * self.attention_scaling).to(self.dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[tokens, head_dim]` for the given positions."""
        if self.kind in STATIC_ROPE_TYPES:
            return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        # dynamic: each token's inverse frequencies for a context of its position + 1.
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](self.config, positions.device, seq_len=positions[:, None] + 1)
        return self._cos_sin(positions, inv_freq)
