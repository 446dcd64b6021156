"""What one scheduler step decided: which sequences compute which tokens, and who was preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass
class ScheduledSeq:
    """``seq`` computes its tokens at positions ``start_pos .. start_pos + num_new_tokens - 1``.

    The last ``len(spec_token_ids)`` of them are proposed tokens being verified (speculative decoding): the
    step needs the logits of the last known token and of each proposed one.
    """

    seq: Sequence
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    start_pos: int = field(init=False)
    is_sampling: bool = field(init=False)
    """This step completes the sequence's known tokens, so a next token is sampled.

    Fixed when scheduled: ``advance`` appends that token, after which the
    sequence has a new uncomputed token again.
    """
    needs_logits: bool = field(init=False)
    """The step computes logits for the sequence: it samples, or it is a static group's padding (which still
    pays for its logits: that is the cost being measured). Fixed when scheduled, as the forward's logit rows are:
    a group member aborted while its step runs becomes padding, and must not gain a row the forward never gave."""

    def __post_init__(self) -> None:
        self.start_pos = self.seq.num_computed_tokens
        self.is_sampling = (
            not self.seq.is_padding and self.start_pos + self.num_new_tokens >= self.seq.num_tokens
        )
        self.needs_logits = self.is_sampling or self.seq.is_padding

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed this step: known ones, then the proposed ones; padding repeats the last real token."""
        seq, start = self.seq, self.start_pos
        if self.num_new_tokens == 1 and not self.spec_token_ids:
            # A decode step's one token (the usual case), unless padding runs past the known tokens.
            num_prompt = len(seq.prompt_token_ids)
            if start < num_prompt:
                return [seq.prompt_token_ids[start]]
            if start - num_prompt < len(seq.output_token_ids):
                return [seq.output_token_ids[start - num_prompt]]
        end = start + self.num_new_tokens - self.num_spec_tokens
        # Slices of prompt and output, rather than of their concatenation: a decode step costs O(1), not O(length).
        num_prompt = seq.num_prompt_tokens
        known = seq.prompt_token_ids[start:end] if start < num_prompt else []
        if end > num_prompt:
            known += seq.output_token_ids[max(0, start - num_prompt) : end - num_prompt]
        if self.spec_token_ids:
            return known + self.spec_token_ids
        last = seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1]
        return known + [last] * (self.num_new_tokens - len(known))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
