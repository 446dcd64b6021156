"""Turning a step's logits into one token per sequence.

Order of work per row: penalties (repetition over prompt+output, presence
and frequency over output), suppression of the given ids, then either argmax
(temperature 0) or temperature → top-k → top-p → min-p and one random draw.

The draw is an exponential race: with `E_i ~ Exp(1)` i.i.d.,
`argmax_i p_i / E_i` is distributed as `p`. For a request with a seed the
noise comes from a generator seeded by `(seed, position)`, always on the CPU,
so the token is a pure function of `(seed, position, logits)` whatever the
batch or device. Unseeded rows draw from a generator the Sampler owns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from scheduler.params import SamplingParams


@dataclass
class SampleRequest:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    position: int
    """Absolute position of the token being sampled; keys the seeded draw."""
    suppress_token_ids: list[int]
    """Ids that must not be drawn this step (stop/EOS tokens before min_tokens)."""


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None
    """Log-probability of the token under the final distribution, when logprobs were asked for."""
    top_logprobs: dict[int, float] | None
    """The most likely alternatives under that distribution (tokens ruled out are left off)."""


def seeded_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator


def apply_penalties(logits: torch.Tensor, request: SampleRequest) -> None:
    """Penalise one row of logits in place.

    Repetition (transformers semantics): every token seen in prompt or output
    has a positive logit divided by the penalty, a negative one multiplied.
    Presence and frequency (OpenAI semantics): subtract
    `presence * [count > 0] + frequency * count`, counting output tokens only.
    """
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


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every token outside top-k, then outside the top-p nucleus, then below min-p.

    `logits` `[n, vocab]` (already divided by temperature); `top_k` `[n]`
    (0 keeps all), `top_p` `[n]`, `min_p` `[n]`. The most likely token always stays.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    is_cut = ranks >= k
    sorted_logits = sorted_logits.masked_fill(is_cut, float("-inf"))
    # Nucleus on the top-k distribution: drop a token once the mass before it reaches top_p.
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    is_cut |= mass_before >= top_p.unsqueeze(-1)
    # Min-p relative to the most likely token's probability.
    is_cut |= sorted_probs < min_p.unsqueeze(-1) * sorted_probs[:, :1]
    is_cut[:, 0] = False
    cut = torch.zeros_like(is_cut).scatter(-1, sorted_idx, is_cut)
    return logits.masked_fill(cut, float("-inf"))


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator(device="cpu")
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampledToken]:
        assert logits.ndim == 2 and logits.shape[0] == len(requests), (logits.shape, len(requests))
        logits = logits.float()
        if any(r.params.has_penalties or r.suppress_token_ids for r in requests):
            logits = logits.clone()  # the caller's logits stay as they were
            for row, request in enumerate(requests):
                if request.params.has_penalties:
                    apply_penalties(logits[row], request)
                if request.suppress_token_ids:
                    logits[row, request.suppress_token_ids] = float("-inf")
        wants_logprobs = any(r.params.logprobs is not None for r in requests)
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if not random_rows:
            # All greedy: one argmax over the batch and one transfer to the host.
            token_ids = logits.argmax(dim=-1)
            if not wants_logprobs:
                return [SampledToken(token_id=t, logprob=None, top_logprobs=None) for t in token_ids.tolist()]
            return self._package(logits, token_ids, requests)
        all_random = len(random_rows) == len(requests)
        filtered = self._filtered(logits if all_random else logits[random_rows], [requests[i] for i in random_rows])
        noise = self._exponential_noise([requests[i] for i in random_rows], logits.shape[-1]).to(logits.device)
        drawn = (filtered.softmax(dim=-1) / noise).argmax(dim=-1)
        if all_random:
            return self._package(filtered, drawn, requests, wants_logprobs)
        greedy_rows = [i for i, r in enumerate(requests) if r.params.is_greedy]
        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        token_ids[random_rows] = drawn
        final = logits
        if wants_logprobs:
            final = logits.clone()
            final[random_rows] = filtered
        return self._package(final, token_ids, requests, wants_logprobs)

    @staticmethod
    def _filtered(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """The sampled rows' logits over temperature, with their top-k/top-p/min-p cuts (a new tensor)."""
        chosen = [r.params for r in requests]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in chosen], device=device).unsqueeze(-1)
        filtered = logits / temperature
        # top_p 1 keeps every token (transformers skips its top-p warper there too), so a step
        # whose rows ask for no filter skips the sort over the vocabulary.
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in chosen):
            filtered = filter_logits(
                filtered,
                top_k=torch.tensor([p.top_k for p in chosen], device=device),
                top_p=torch.tensor([p.top_p for p in chosen], device=device),
                min_p=torch.tensor([p.min_p for p in chosen], device=device),
            )
        return filtered

    def _exponential_noise(self, requests: list[SampleRequest], vocab: int) -> torch.Tensor:
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if len(unseeded) == len(requests):
            # The same draws from the Sampler's generator as filling these rows of a bigger tensor.
            return torch.empty(len(requests), vocab).exponential_(generator=self._generator)
        noise = torch.empty(len(requests), vocab)
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab).exponential_(generator=self._generator)
        for i, request in enumerate(requests):
            if request.params.seed is not None:
                noise[i].exponential_(generator=seeded_generator(request.params.seed, request.position))
        return noise

    @staticmethod
    def _package(final: torch.Tensor, token_ids: torch.Tensor, requests: list[SampleRequest],
                 wants_logprobs: bool = True) -> list[SampledToken]:
        ids = token_ids.tolist()
        if not wants_logprobs:
            return [SampledToken(token_id=t, logprob=None, top_logprobs=None) for t in ids]
        wants = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        logprob_of: dict[int, float] = {}
        top_of: dict[int, dict[int, float]] = {}
        if wants:
            logprobs = final[wants].log_softmax(dim=-1)
            chosen = logprobs.gather(-1, token_ids[wants].unsqueeze(-1)).squeeze(-1).tolist()
            num_top = max(requests[i].params.logprobs or 0 for i in wants)
            top_values: list[list[float]] = []
            top_ids: list[list[int]] = []
            if num_top:
                # One transfer of the whole top-k to the host, not one per row.
                values_t, ids_t = logprobs.topk(num_top, dim=-1)
                top_values, top_ids = values_t.tolist(), ids_t.tolist()
            for j, i in enumerate(wants):
                logprob_of[i] = chosen[j]
                top: dict[int, float] = {}
                n = requests[i].params.logprobs or 0
                if n:
                    for value, token in zip(top_values[j][:n], top_ids[j][:n]):
                        if value != float("-inf"):
                            top[token] = value
                top_of[i] = top
        return [
            SampledToken(token_id=ids[i], logprob=logprob_of.get(i), top_logprobs=top_of.get(i))
            for i in range(len(requests))
        ]
