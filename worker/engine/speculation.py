"""Speculative decoding: who proposes how many tokens each step, and what came of it.

Before each schedule the engine asks the ``Speculator`` to propose next
tokens for every running sequence that is decoding (its known tokens all
computed but the last). The scheduler appends them to the sequence's query,
the step computes them with everything else, and the sampler verifies them
(``Sampler.verify``): the accepted ones and the token after them become
output in one step. Two proposers:

- ``ngram`` (prompt lookup): the longest n-gram (``MAX_NGRAM`` down to
  ``MIN_NGRAM`` tokens) that ends the sequence and occurred before in its own
  prompt + output; the proposal is what followed that occurrence, extended
  periodically when it runs into the end.
- ``draft``: a smaller checkpoint with the same tokenizer, run by a model
  runner of its own over a paged cache of its own (``worker.engine.draft_model``).

Per sequence the number of proposed tokens adapts: a fully accepted proposal
raises it by one (up to ``num_speculative_tokens``), a partly accepted one
sets it to the accepted length + 1, a fully rejected one halves it; at zero
the sequence stops speculating for a pause that doubles each time (from
``FIRST_PAUSE_STEPS`` to ``MAX_PAUSE_STEPS`` steps) and then tries one token
again. A batch of unpredictable jobs so pays for a few short proposals per
job, not for k tokens every step.

Requests that opt out (``SamplingParams.speculative``), use penalties (their
counts would have to advance inside a proposal) or still hold back stop
tokens (``min_tokens``) never speculate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from scheduler.sequence import Sequence, SequenceStatus
from worker.engine.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

MIN_NGRAM = 2
MAX_NGRAM = 4
FIRST_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256


class Proposer(str, Enum):
    NGRAM = "ngram"
    DRAFT = "draft"



def parse_speculative(name: str | None) -> Proposer | None:
    if name is None:
        return None
    try:
        return Proposer(name)
    except ValueError:
        raise ValueError(f"speculative: must be one of {', '.join(SPECULATIVE_METHODS)} or unset, "
                         f"got {name!r}") from None


class DraftProposer(Protocol):
    """A proposer that keeps state per request (the draft model's cache)."""

    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Up to `k` next tokens for each `(request_id, known token ids, k)`.

        The known tokens may have lost a tail since the last call (rejected proposals): the proposer keeps
        only the state of the prefix they still share.
        """
        ...

    def release(self, request_id: str) -> None: ...


class NgramIndex:
    """Where each n-gram of one sequence last ended, kept up to date as the sequence grows."""

    def __init__(self, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> None:
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(max_n, min_n - 1, -1)}
        self._num_indexed = 0
        """N-grams ending before this position are indexed; the sequence's last one never is, so a lookup of
        the sequence's own end finds an earlier occurrence."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        end = len(tokens) - 1
        for j in range(self._num_indexed, end):
            for n, table in self._tables.items():
                if j + 1 >= n:
                    table[tuple(tokens[j + 1 - n : j + 1])] = j
        self._num_indexed = max(self._num_indexed, end)
        for n, table in self._tables.items():
            if len(tokens) < n:
                continue
            found = table.get(tuple(tokens[-n:]))
            if found is not None:
                period = end - found
                return [tokens[found + 1 + i % period] for i in range(k)]
        return []


@dataclass
class _SeqState:
    k: int
    pause_steps: int = FIRST_PAUSE_STEPS
    paused_for: int = 0
    ngrams: NgramIndex = field(default_factory=NgramIndex)


@dataclass
class SpecCounters:
    num_drafts: int = 0
    """Proposals verified (one per speculating sequence and step)."""
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, draft: DraftProposer | None = None) -> None:
        assert num_speculative_tokens >= 1
        assert (draft is not None) == (proposer is Proposer.DRAFT)
        self.proposer = proposer
        self.max_k = num_speculative_tokens
        self.draft = draft
        self._states: dict[str, _SeqState] = {}
        self.counters = SpecCounters()

    def propose(self, running: Iterable[Sequence], max_model_len: int) -> None:
        """Set ``spec_token_ids`` of every running sequence: a proposal, or none."""
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.spec_token_ids = []
            k = self._wanted_k(seq, max_model_len)
            if k:
                wanted.append((seq, k))
        if not wanted:
            return
        if self.draft is not None:
            proposals = self.draft.propose([(seq.request_id, seq.token_ids, k) for seq, k in wanted])
            for seq, _ in wanted:
                seq.spec_token_ids = proposals.get(seq.request_id, [])
            return
        for seq, k in wanted:
            seq.spec_token_ids = self._states[seq.request_id].ngrams.propose(seq.token_ids, k)

    def _wanted_k(self, seq: Sequence, max_model_len: int) -> int:
        params = seq.params
        if (seq.status is not SequenceStatus.RUNNING or seq.is_padding or not params.speculative
                or params.has_penalties or seq.num_output_tokens < params.min_tokens
                or seq.num_uncomputed_tokens != 1):
            return 0
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _SeqState(self.max_k)
        if state.paused_for > 0:
            state.paused_for -= 1
            if state.paused_for == 0:
                state.k = 1
            return 0
        # Never propose past max_tokens (the token after an accepted run counts too) or the context.
        room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
        return max(0, min(state.k, room))

    def cut_by_stop(self, num_tokens: int) -> None:
        """A stop cut the last `num_tokens` tokens of a step's run from the output: accepted ones among them saved
        no forward, and are not counted as accepted (the run's last token, drawn from the verify logits, is the
        one not proposed, so `num_tokens` accepted ones go at most)."""
        self.counters.num_accepted_tokens -= num_tokens

    def verified(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A proposal of ``seq`` was verified; adapts its length and counts it."""
        if num_proposed == 0:
            return
        counters = self.counters
        counters.num_drafts += 1
        counters.num_proposed_tokens += num_proposed
        counters.num_accepted_tokens += num_accepted
        state = self._states.get(seq.request_id)
        if state is None:
            return
        if num_accepted == num_proposed:
            state.k = min(self.max_k, state.k + 1)
            state.pause_steps = FIRST_PAUSE_STEPS
        elif num_accepted > 0:
            state.k = min(self.max_k, num_accepted + 1)
        else:
            state.k //= 2
            if state.k == 0:
                state.paused_for = state.pause_steps
                state.pause_steps = min(MAX_PAUSE_STEPS, 2 * state.pause_steps)

    def release(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self._states.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)
