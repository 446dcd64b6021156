"""transformers' dynamic and LongRoPE rotary embeddings, made to depend on each token's own position.

transformers computes these frequencies from the largest position of the call: `dynamic` NTK scaling
stretches them for `max(position) + 1`, LongRoPE picks its long or short factors by whether that passes the
original context. carpool runs every sequence of a step in one call, its tokens laid end to end, so one
sequence past the original context would change the frequencies of every other sequence in the step, and a
job's tokens would depend on what it was batched with. Wrapped here, a token's frequencies follow its own
position only, as carpool's own models compute them (``worker.engine.models.rope``): positions inside the
original context take the original frequencies, one call for all of them; a LongRoPE position past it the
long factors, one call for all of those; a dynamic position past it the frequencies scaled for that
position, one call per distinct position (a prefill past the original context makes many small calls; a
decode step one per sequence there).

A module whose state is kept per layer type (a config with ``layer_types``) is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch

POSITIONAL_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def make_positional(model: torch.nn.Module) -> int:
    """Wrap every rotary embedding of `model` whose frequencies follow the call's largest position; how many."""
    wrapped = 0
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if (isinstance(kind, str) and kind in POSITIONAL_ROPE_TYPES and hasattr(module, "original_inv_freq")
                and hasattr(module, "inv_freq")):
            module.forward = _PositionalRope(module, kind)  # type: ignore[method-assign]
            wrapped += 1
    return wrapped


class _PositionalRope:
    def __init__(self, module: torch.nn.Module, kind: str) -> None:
        self.module = module
        self.kind = kind
        self.inner = module.forward  # the bound forward, transformers' update included
        config: Any = getattr(module, "config", None)
        parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        original: Any = parameters.get("original_max_position_embeddings") if isinstance(parameters, dict) else None
        fallback: Any = getattr(module, "original_max_seq_len", 0) or getattr(config, "max_position_embeddings", 0)
        self.original = int(original or fallback)
        """Positions below this take the original frequencies."""

    def _reset(self) -> None:
        """The module as it was made, so that a call's update starts from the original frequencies."""
        module: Any = self.module
        module.inv_freq.copy_(module.original_inv_freq.to(module.inv_freq.device))
        if self.kind == "dynamic":
            module.max_seq_len_cached = module.original_max_seq_len

    def _call(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._reset()
        cos, sin = self.inner(x, positions.reshape(1, -1))
        return cos, sin

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert not args and not kwargs, "a rotary embedding called with more than (x, position_ids)"
        flat = position_ids.reshape(-1)
        past = flat >= self.original
        if not bool(past.any()):
            return self._call(x, flat)
        groups: list[torch.Tensor] = []  # token indices, each group one call
        inside = (~past).nonzero().flatten()
        if inside.numel():
            groups.append(inside)
        beyond = past.nonzero().flatten()
        if self.kind == "longrope":
            groups.append(beyond)
        else:
            for position in flat[beyond].unique():
                groups.append((flat == position).nonzero().flatten())
        cos_out: torch.Tensor | None = None
        sin_out: torch.Tensor | None = None
        for index in groups:
            cos, sin = self._call(x, flat[index])
            if cos_out is None or sin_out is None:
                cos_out = cos.new_empty((1, flat.numel(), cos.shape[-1]))
                sin_out = sin.new_empty((1, flat.numel(), sin.shape[-1]))
            cos_out[0, index] = cos[0]
            sin_out[0, index] = sin[0]
        assert cos_out is not None and sin_out is not None
        return cos_out.reshape(*position_ids.shape, -1), sin_out.reshape(*position_ids.shape, -1)
