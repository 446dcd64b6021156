"""Turning a step's logits into one token per sequence.

Order of work per row: penalties (repetition over prompt+output, presence
and frequency over output), suppression of the given ids, then either argmax
(temperature 0) or temperature → top-k → top-p → min-p and one random draw.

The draw is an exponential race: with `E_i ~ Exp(1)` i.i.d.,
`argmax_i p_i / E_i` is distributed as `p`. The noise `E` is a hash of
`(seed, position, token)` computed on the logits' device (worker/engine/noise.py),
so a seeded request's token is a pure function of `(seed, position, logits)`
whatever the batch. Unseeded rows draw their noise from the Sampler's own
generator on the device in one pass (the hash takes about forty). On a GPU a
step whose sampled rows neither filter, nor are seeded, nor ask for logprobs
(the default request's step) draws in one Triton kernel instead of a dozen
torch calls (kernels/sample_race.py): the same race in log space, its noise
from Triton's counter-based generator under a seed per step that the
Sampler's seed decides. On a CPU,
a step without seeded rows draws by inverse CDF instead (`inverse_cdf_draw`):
one uniform number per row rather than an exponential per token, which
for a vocabulary of 100k tokens is most of the draw's time there.

All of it runs on the logits' device; the host learns the step's results by
one copy at the end, started by `Sampler.launch` and waited for by
`Sampler.collect`, so that a next step can be launched in between (fed the
drawn ids on the device). A decode step usually samples the same requests as
the step before: `launch` then reuses that step's rows on the device, their
parameters and what its work branches on (`_BatchRows`), so such a step sends
the device nothing unless a row is seeded (its positions) or has ids to
suppress, and the host's work per request is a few comparisons.
"""

from __future__ import annotations

import itertools
import logging
import operator
import random
from dataclasses import dataclass

import torch

from kernels.sample_race import MAX_COUNTER, SEED_RANGE, sample_race
from scheduler.params import SamplingParams
from worker.engine.noise import exponential_noise, token_keys
from worker.engine.penalties import penalise_rows
from worker.engine.sampling_rows import (
    FREQUENCY, IS_PENALISED, MIN_P, PRESENCE, REPETITION, SEED, TEMPERATURE, TOP_K, TOP_P, Row, SamplingRows,
    to_device,
)

# Noise elements computed at once on a CPU: 4 MiB of int64, so the hash's passes stay in cache.
CPU_NOISE_CHUNK_ELEMENTS = 1 << 19

log = logging.getLogger(__name__)


@dataclass
class SampleRequest:
    request_id: str
    """Keys the request's device row; the same id must mean the same request until released."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    position: int
    """Absolute position of the token being sampled; keys the seeded draw."""
    suppress_token_ids: list[int]
    """Ids that must not be drawn this step (stop/EOS tokens before min_tokens)."""


@dataclass
class DrawnTokens:
    """A step's tokens drawn on the device, on their way to the host (`Sampler.collect` reads them)."""

    token_ids: torch.Tensor
    """`[rows]` int64 on the device: a next step can take its inputs from here before the host knows them."""
    host: torch.Tensor
    """Where the packed results land (pinned memory on CUDA; the packed tensor itself on a CPU)."""
    copied: torch.cuda.Event | None
    """Recorded after the copy to `host` on CUDA."""
    params: list[SamplingParams]
    """Each row's parameters."""
    num_top: int | None
    request_ids: list[str]
    """The requests with penalties, whose rows' counts take the drawn tokens (`SamplingRows.note_read`)."""
    rows: list[Row]
    """Each of those requests' sampling row when drawn."""
    num_outputs: list[int]
    """Each of those requests' output length counting the drawn token (the penalty rows' record of it)."""
    first_rows: list[int]
    """Each of those requests' first row."""


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None
    """Log-probability of the token under the final distribution, when logprobs were asked for."""
    top_logprobs: dict[int, float] | None
    """The most likely alternatives under that distribution (tokens ruled out are left off)."""


def inverse_cdf_draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` `[rows, vocab]`, token i with probability `probs[i]` over the row's sum: the
    first whose running sum (in float64) exceeds a uniform draw scaled to that sum. A token of probability 0 is
    never drawn."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # a third of cumsum(dtype=float64)'s time on a CPU
    draw = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)
    # A row that is NaN throughout (logits that are, from a broken model) finds no index; the clamp keeps its
    # token a valid id.
    return torch.searchsorted(cdf, draw * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


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
    """Samples a step's tokens on the logits' device, with one copy of the results to the host.

    Per-request parameters and penalty counts live in device rows (worker/engine/sampling_rows.py), keyed
    by request id: `release` a request's row when it finishes, aborts or is preempted.
    """

    def __init__(
        self,
        vocab_size: int,
        max_num_seqs: int = 64,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        race_kernel: bool | None = None,
    ) -> None:
        """`race_kernel`: steps whose sampled rows neither filter, nor are seeded, nor ask for logprobs draw in one
        Triton kernel (kernels/sample_race.py); None: on CUDA, once the kernel passes its start-up check."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._rows = SamplingRows(vocab_size, max_num_seqs, self.device)
        # The noise of unseeded rows; never the process-wide generators.
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # The race kernel's seed for each step, from the host: drawing it costs the device nothing.
        self._race_seeds = random.Random(seed)
        if race_kernel is None and self.device.type == "cuda":
            from worker.engine.kernel_checks import check_sample_race

            failure = check_sample_race(self.device, vocab_size)
            if failure is not None:
                log.warning("the sampler's race kernel failed its start-up check (%s); sampling runs torch ops",
                            failure)
            race_kernel = failure is None
        self._race_kernel = bool(race_kernel)
        self._token_keys = token_keys(vocab_size, self.device)
        self._noise_rows_per_chunk = None if self.device.type == "cuda" else CPU_NOISE_CHUNK_ELEMENTS // vocab_size
        self._is_cuda = self.device.type == "cuda"
        self._last_batch: _BatchRows | None = None

    def release(self, request_id: str) -> None:
        """Free the request's row (no-op for an unknown id)."""
        self._rows.release(request_id)

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampledToken]:
        """One token per request from its row of `logits` `[len(requests), vocab]`."""
        return self._sample(logits, requests, [1] * len(requests))

    def verify(self, logits: torch.Tensor, requests: list[SampleRequest],
               proposals: list[list[int]]) -> list[list[SampledToken]]:
        """Each request's accepted proposed tokens and the token after them (speculative decoding).

        Request `i` has `len(proposals[i]) + 1` consecutive rows of `logits`: its last known token's and each
        proposed token's, at positions `position, position + 1, ...`. Every row draws the token the target
        model gives there exactly as `sample` would (argmax, or the exponential race with the noise of
        (seed, position) for a seeded request), and the proposal is accepted up to its first token that
        differs from the draw. So the tokens are those of decoding without proposals: for a greedy request
        the longest matching prefix, for a sampled one rejection sampling of a proposal that is certain to
        its proposer (a token is accepted with its target probability; a rejected one is replaced by a draw
        from the target distribution without it). Requests with proposals take no penalties nor suppressed ids.
        """
        counts = [len(p) + 1 for p in proposals]
        for request, proposal in zip(requests, proposals):
            assert not proposal or not (request.params.has_penalties or request.suppress_token_ids), request
        drawn = self._sample(logits, requests, counts)
        accepted: list[list[SampledToken]] = []
        start = 0
        for proposal, count in zip(proposals, counts):
            rows = drawn[start:start + count]
            num_accepted = next((i for i, (p, t) in enumerate(zip(proposal, rows)) if p != t.token_id), len(proposal))
            accepted.append(rows[: num_accepted + 1])
            start += count
        return accepted

    def _sample(self, logits: torch.Tensor, requests: list[SampleRequest], counts: list[int]) -> list[SampledToken]:
        return self.collect(self.launch(logits, requests, counts))

    def launch(self, logits: torch.Tensor, requests: list[SampleRequest],
               counts: list[int] | None = None) -> DrawnTokens:
        """Draw the tokens on the device and start their copy to the host, without waiting: `collect` reads them,
        and the drawn ids (`DrawnTokens.token_ids`) can feed a next step's inputs before then.

        `counts[i]` rows of `logits` (default one) belong to request `i`, at its position and the ones after it;
        a request with penalties or suppressed ids has one.
        """
        counts = counts if counts is not None else [1] * len(requests)
        batch = self._batch_rows(requests, counts)
        num_rows = batch.first_rows[-1]
        assert logits.ndim == 2 and logits.shape == (num_rows, self.vocab_size), (logits.shape, num_rows)
        penalised = [requests[i] for i in batch.penalised]
        if penalised:
            self._rows.refresh_counts(penalised)
        # What changes from step to step goes to the device in one transfer: the positions of seeded rows (their
        # noise's key) and the suppressed (row, id) pairs. A stop id past the vocabulary can never be drawn, so
        # there is nothing of it to suppress (and no logit).
        positions = ([r.position + i for r, n in zip(requests, counts) for i in range(n)] if batch.seeded else [])
        suppressed = [(batch.first_rows[i], t) for i, r in enumerate(requests) if r.suppress_token_ids
                      for t in r.suppress_token_ids if t < self.vocab_size]
        positions_t = suppress_rows_t = suppress_ids_t = None
        if positions or suppressed:
            parts = [positions, [row for row, _ in suppressed], [t for _, t in suppressed]]
            step = to_device([v for part in parts for v in part], torch.int64, self.device)
            positions_t, suppress_rows_t, suppress_ids_t = step.split([len(p) for p in parts])

        logits = logits.float()
        if batch.has_penalties:
            assert self._rows.prompt_seen is not None and self._rows.output_counts is not None
            floats = batch.floats
            logits = penalise_rows(
                logits, self._rows.prompt_seen[batch.index], self._rows.output_counts[batch.index],
                floats[:, REPETITION:REPETITION + 1], floats[:, PRESENCE:PRESENCE + 1],
                floats[:, FREQUENCY:FREQUENCY + 1],
            )
        if suppressed:
            assert suppress_rows_t is not None and suppress_ids_t is not None
            if not batch.has_penalties:
                logits = logits.clone()  # the caller's logits stay as they were
            logits.index_put_((suppress_rows_t, suppress_ids_t), torch.full((), float("-inf"), device=self.device))

        if batch.all_greedy:
            final, token_ids = logits, logits.argmax(dim=-1)
        elif batch.races:
            assert batch.temperature is not None
            final, token_ids = logits, sample_race(logits, batch.temperature, self._race_seeds.randrange(SEED_RANGE))
        else:
            final, token_ids = self._draw(logits, batch, positions_t)
        if batch.has_penalties:
            self._rows.count_sampled(batch.index, token_ids, batch.ints[:, IS_PENALISED])
        # Penalty counts follow the first row of each request: the only one of a request with penalties.
        self._rows.note_drawn(penalised)
        packed = _packed(final, token_ids, batch.num_top)
        if not self._is_cuda:
            host, copied = packed, None
        else:
            # A pinned block per step from torch's caching host allocator, which hands it out again only once its
            # copy is done: a step launched before the last one's tokens were read cannot overwrite them.
            host = torch.empty(packed.numel(), dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return DrawnTokens(token_ids=token_ids, host=host, copied=copied, params=batch.params, num_top=batch.num_top,
                           request_ids=[batch.request_ids[i] for i in batch.penalised],
                           rows=[batch.rows[i] for i in batch.penalised],
                           num_outputs=[len(r.output_token_ids) + 1 for r in penalised],
                           first_rows=[batch.first_rows[i] for i in batch.penalised])

    def _batch_rows(self, requests: list[SampleRequest], counts: list[int]) -> _BatchRows:
        """The step's rows and what follows from its requests' parameters: the last step's when it sampled the
        same request objects in the same order, with the same counts and no row assigned or freed since (the
        usual decode step), else made anew."""
        last = self._last_batch
        # By identity: the engine keeps one SampleRequest per request, never reused under another id.
        if (last is not None and last.version == self._rows.version and last.counts == counts
                and len(last.requests) == len(requests) and all(map(operator.is_, last.requests, requests))
                and all(map(operator.is_, last.request_params, map(_PARAMS, requests)))):
            return last
        request_rows = self._rows.assign(requests)
        row_index = [row.index for row, n in zip(request_rows, counts) for _ in range(n)]
        params = [r.params for r, n in zip(requests, counts) for _ in range(n)]
        index = to_device(row_index, torch.int64, self.device)
        floats, ints = self._rows.floats[index], self._rows.ints[index]
        divisor = None
        if not all(p.is_greedy for p in params):
            # Greedy rows are tempered by 1 (their draw is discarded), so a mixed step needs no gathers.
            temperature = floats[:, TEMPERATURE:TEMPERATURE + 1]
            divisor = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
        filters = any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        races = (self._race_kernel and divisor is not None and not filters and not seeded and num_top is None
                 and len(params) * self.vocab_size < MAX_COUNTER)
        batch = _BatchRows(
            requests=list(requests), request_params=[r.params for r in requests], counts=list(counts),
            version=self._rows.version, rows=request_rows,
            request_ids=[r.request_id for r in requests], first_rows=list(itertools.accumulate(counts, initial=0)),
            index=index, floats=floats, ints=ints, divisor=divisor, params=params,
            all_greedy=divisor is None, any_greedy=any(p.is_greedy for p in params),
            has_penalties=any(p.has_penalties for p in params),
            penalised=[i for i, r in enumerate(requests) if r.params.has_penalties],
            filters=filters, seeded=seeded, num_top=num_top, races=races,
            temperature=floats[:, TEMPERATURE].contiguous() if races else None,
        )
        self._last_batch = batch
        return batch

    def collect(self, drawn: DrawnTokens) -> list[SampledToken]:
        """The drawn tokens on the host, one per row: waits for their copy (the step's only wait)."""
        if drawn.copied is not None:
            drawn.copied.synchronize()
        values = drawn.host.tolist()
        num_rows = len(drawn.params)
        ids: list[int] = values[:num_rows] if drawn.num_top is None else [int(v) for v in values[:num_rows]]
        for request_id, row, num_output, first in zip(drawn.request_ids, drawn.rows, drawn.num_outputs,
                                                     drawn.first_rows):
            self._rows.note_read(request_id, row, num_output, ids[first])
        if drawn.num_top is None:
            return [SampledToken(t, None, None) for t in ids]
        return _unpacked(values, ids, drawn.params, drawn.num_top)

    def _draw(self, logits: torch.Tensor, batch: _BatchRows,
              positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The distribution each row samples from and its token: the race for sampled rows, argmax for greedy ones.

        Greedy rows go through the same batched ops (tempered by 1, their draw then discarded), so a
        mixed step has no per-subset gathers. `positions`: each row's, when some row is seeded.
        """
        assert batch.divisor is not None
        # Each row shifted by its largest logit before the division, which leaves every distribution and filter
        # as it was (they depend on differences of logits only) but cannot overflow: with a temperature so small
        # that logit / temperature passes the float range (1e-40, say), the row's top logits become 0 and the
        # rest -inf, the argmax the distribution tends to, instead of infinities whose softmax is NaN.
        filtered = (logits - logits.amax(dim=-1, keepdim=True)).div_(batch.divisor)
        if batch.filters:
            filtered = filter_logits(filtered, batch.ints[:, TOP_K], batch.floats[:, TOP_P], batch.floats[:, MIN_P])
        # The exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is distributed as p.
        seeded = batch.seeded
        if not seeded and self.device.type == "cpu":
            drawn = inverse_cdf_draw(filtered.softmax(dim=-1), self._generator)
        else:
            if len(seeded) == len(batch.params):
                assert positions is not None
                noise = exponential_noise(batch.ints[:, SEED], positions, self._token_keys,
                                          self._noise_rows_per_chunk)
            else:
                noise = torch.empty_like(filtered).exponential_(generator=self._generator)
                if seeded:
                    assert positions is not None
                    index = batch.seeded_index()
                    noise[index] = exponential_noise(batch.ints[index, SEED], positions[index], self._token_keys,
                                                     self._noise_rows_per_chunk)
            drawn = filtered.softmax(dim=-1).div_(noise).argmax(dim=-1)
        if not batch.any_greedy:
            return filtered, drawn
        is_greedy = batch.floats[:, TEMPERATURE:TEMPERATURE + 1] == 0.0
        return torch.where(is_greedy, logits, filtered), torch.where(is_greedy.squeeze(-1), logits.argmax(dim=-1), drawn)


@dataclass
class _BatchRows:
    """What `Sampler.launch` derives from a step's requests and their parameters, kept for the next steps while
    they sample the same requests: their rows on the device, those rows' parameters gathered, and what the step's
    work branches on."""

    requests: list[SampleRequest]
    """The caller's objects, compared by identity."""
    request_params: list[SamplingParams]
    counts: list[int]
    version: int
    """`SamplingRows.version` when made: a row assigned or freed since makes it stale."""
    rows: list[Row]
    request_ids: list[str]
    first_rows: list[int]
    """Each request's first row of the logits, then their number."""
    index: torch.Tensor
    """`[rows]` each logits row's sampling row, on the device."""
    floats: torch.Tensor
    ints: torch.Tensor
    divisor: torch.Tensor | None
    """`[rows, 1]` each row's temperature, 1 for greedy rows; None when every row is greedy."""
    params: list[SamplingParams]
    """Each logits row's parameters."""
    all_greedy: bool
    any_greedy: bool
    has_penalties: bool
    penalised: list[int]
    """The requests with penalties (by position), the only ones whose draws the rows' counts follow."""
    filters: bool
    """Some sampled row filters (top-k, top-p, min-p): top_p 1 keeps every token (transformers skips its top-p
    warper there too), so a step whose sampled rows ask for no filter skips the sort over the vocabulary."""
    seeded: list[int]
    """Rows whose noise is their seed's."""
    num_top: int | None
    races: bool
    """The step draws in the race kernel: some row samples, and none filters, is seeded or asks for logprobs."""
    temperature: torch.Tensor | None
    """`[rows]` each row's temperature, when the step races."""
    _seeded_index: torch.Tensor | None = None

    def seeded_index(self) -> torch.Tensor:
        if self._seeded_index is None:
            self._seeded_index = to_device(self.seeded, torch.int64, self.index.device)
        return self._seeded_index


_PARAMS = operator.attrgetter("params")


def _packed(final: torch.Tensor, token_ids: torch.Tensor, num_top: int | None) -> torch.Tensor:
    """The token ids (int64), or when logprobs are asked for, the ids, each row's logprob and top values and ids, as
    float64: ids below 2^53 and float32 logprobs are exact in float64, so one tensor carries them all.
    """
    if num_top is None:
        return token_ids
    logprobs = final.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    parts = [token_ids.to(torch.float64), chosen.to(torch.float64)]
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        parts += [top_values.to(torch.float64).flatten(), top_ids.to(torch.float64).flatten()]
    return torch.cat(parts)


def _unpacked(values: list[float], ids: list[int], params: list[SamplingParams], num_top: int) -> list[SampledToken]:
    n = len(ids)
    chosen = values[n: 2 * n]
    top_values, top_ids = values[2 * n: 2 * n + n * num_top], values[2 * n + n * num_top:]
    tokens = []
    for i, (token, p) in enumerate(zip(ids, params)):
        if p.logprobs is None:
            tokens.append(SampledToken(token_id=token, logprob=None, top_logprobs=None))
            continue
        row = range(i * num_top, i * num_top + p.logprobs)
        # Tokens ruled out (-inf) are left off.
        top = {int(top_ids[j]): top_values[j] for j in row if top_values[j] != float("-inf")}
        tokens.append(SampledToken(token_id=token, logprob=chosen[i], top_logprobs=top))
    return tokens
