"""A job as this worker runs it, and the outcome it ends with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from scheduler.protocol.job import JobSpec, JobStatus
from scheduler.protocol.webhooks import OutputThrottle
from worker.job_store import EntryRef, Outcome
from worker.job_trace import JobTrace
from worker.text_buffer import TextBuffer


@dataclass
class RunningJob:
    spec: JobSpec
    entry: EntryRef
    resumed_from: int
    token_ids: list[int]
    text_buffer: TextBuffer = field(default_factory=TextBuffer)
    """The output text so far, grown by each step's new text (a string grown by `+=` is copied whole)."""
    attempt: int = 1
    """Which start of the job this is (the record's ``attempts``): on every event, so a subscriber can tell a
    re-run's events (and a repeated ``final``) from the first run's."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_mono: float | None = None
    """Monotonic time this worker last saw new tokens of the job (inter-token latency)."""
    checkpointed: int = 0
    checkpoint_at: float = field(default_factory=time.monotonic)
    throttle: OutputThrottle | None = None
    trace: JobTrace | None = None
    record: dict[bytes, bytes] = field(default_factory=dict)
    """The job record as admitted: the base of ``output`` webhook data."""
    resumed_logprobs: list[dict[str, Any]] = field(default_factory=list)
    """Logprobs of the checkpoint's tokens: the engine reports only those of tokens it generated here."""
    engine_logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The output text so far (joined when read: checkpoints, webhooks and the result read it, not each step)."""
        return self.text_buffer.text

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        """Every output token's logprobs, when the job asked for them."""
        if self.spec.params.logprobs is None:
            return None
        return self.resumed_logprobs + self.engine_logprobs


def output_of(job: RunningJob, finish_reason: str) -> dict[str, Any]:
    """The record's ``output``: everything produced so far, also for a job that ends before it is done."""
    output: dict[str, Any] = {"text": job.text, "token_ids": job.token_ids, "finish_reason": finish_reason}
    if job.spec.params.logprobs is not None:
        output["logprobs"] = job.logprobs
    return output


def outcome_of(job: RunningJob, status: JobStatus, *, output: dict[str, Any] | None = None,
               error: dict[str, str] | None = None, is_refused: bool = False) -> Outcome:
    usage = {"prompt_tokens": job.num_prompt_tokens, "completion_tokens": len(job.token_ids),
             "cached_tokens": job.num_cached_tokens}
    return Outcome(job_id=job.spec.id, status=status, entry=job.entry, reply_to=job.spec.reply_to,
                   webhook=job.spec.webhook, output=output, usage=usage, error=error,
                   first_token_at=job.first_token_at, resumed_from=job.resumed_from, trace=job.trace,
                   traceparent=job.spec.traceparent, is_refused=is_refused)
