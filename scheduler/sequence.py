"""Per-request state as the scheduler and the engine see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from scheduler.params import SamplingParams


PENDING_TOKEN = -1
"""Stands in ``output_token_ids`` for a token drawn on the device whose value the host has not read yet (a step
launched before the previous one's tokens came back): never a vocabulary id."""


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"
    """EOS, a stop token id or a stop string ended the output."""
    LENGTH = "length"
    """max_tokens (or the model's context length) was reached."""
    ABORT = "abort"
    """The request was cancelled."""


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, how far its KV is computed and where that KV lives.

    ``num_computed_tokens`` counts the leading tokens whose KV sits in the
    blocks of ``block_table``; the tokens after it are what the next steps
    compute. Preemption by recompute sets it back to 0 and keeps the outputs,
    so the outputs are recomputed as part of the prompt when it is readmitted.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """Lower runs first (used by the ``priority`` policy and to pick preemption victims)."""
    output_token_ids: list[int] = field(default_factory=list)
    """Only ever appended to, except that tokens past a stop inside one step's accepted speculative run are cut
    before any output reports them: engine outputs read their prefix of it instead of copying it."""
    arrival_order: int = -1
    """Set by the scheduler when the request is added; ties in every policy break on it."""
    arrival_time: float = 0.0
    """Scheduler clock reading when the request was added, in seconds."""
    admit_order: int = -1
    """Set each time the scheduler admits the sequence; the latest admitted is preempted first."""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the leading full, computed blocks of ``block_table``."""
    token_hashes: list[bytes] = field(default_factory=list, repr=False)
    """Chained hashes of the leading full blocks of ``token_ids`` computed so far, whether or not the blocks are
    in the table: kept across preemptions (tokens are only ever appended), so that they are hashed once."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the last admission."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the output; None for EOS or length."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed next tokens, not yet verified, that the next step computes after the known ones (speculative
    decoding); set before each schedule. Never part of ``token_ids``, the prefix cache or the outputs."""
    is_padding: bool = False
    """Static/dynamic batching only: finished, but still occupying its slot in the group."""
    num_pending_tokens: int = 0
    """The last output tokens that are ``PENDING_TOKEN`` until the step that drew them is read (at most one when
    a step is scheduled): they count in the sequence's length, its next step computes them, but no output
    reports them yet."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """The output limit; a request's ``max_tokens=None`` (the rest of the context) is resolved before it
        becomes a Sequence."""
        assert self.params.max_tokens is not None, "max_tokens is resolved when the request is added"
        return self.params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_known_output_tokens(self) -> int:
        """The output tokens whose values are known: all but the pending ones at the end."""
        return len(self.output_token_ids) - self.num_pending_tokens

    def truncate_output(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` output tokens (a stop among them): the ones after go, pending ones too."""
        num_cut = len(self.output_token_ids) - num_tokens
        del self.output_token_ids[num_tokens:]
        self.num_pending_tokens -= min(num_cut, self.num_pending_tokens)

    def drop_pending_tokens(self) -> None:
        """Forget the pending tokens (the sequence finished before anyone needed them)."""
        if self.num_pending_tokens:
            del self.output_token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
