"""Repetition, presence and frequency penalties: batched on count tensors, and the per-row reference.

Repetition (transformers semantics): every token seen in prompt or output
has a positive logit divided by the penalty, a negative one multiplied.
Presence and frequency (OpenAI semantics): subtract
`presence * [count > 0] + frequency * count`, counting output tokens only.
"""

from __future__ import annotations

from typing import Protocol

import torch

from scheduler.params import SamplingParams


class PenalisedRequest(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def penalise_rows(
    logits: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits (a new tensor) for `[n, vocab]` logits.

    `prompt_seen` `[n, vocab]` bool, `output_counts` `[n, vocab]` int; the penalties `[n, 1]` float32.
    A row with no penalty (1, 0, 0) comes out unchanged bit for bit, whatever its counts hold: x / 1,
    x * 1 and x - 0 are exact, so such rows need no counts of their own.
    """
    counts = output_counts.to(logits.dtype)
    seen = prompt_seen | (output_counts > 0)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - (frequency * counts + presence * (counts > 0).to(logits.dtype))


def apply_penalties(logits: torch.Tensor, request: PenalisedRequest) -> None:
    """Penalise one row of logits in place, from the request's token lists: the reference for `penalise_rows`."""
    params = request.params
    if params.repetition_penalty != 1.0:
        seen = sorted(set(request.prompt_token_ids) | set(request.output_token_ids))
        if seen:
            ids = torch.tensor(seen, dtype=torch.long, device=logits.device)
            values = logits[ids]
            penalty = params.repetition_penalty
            logits[ids] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0) and request.output_token_ids:
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
