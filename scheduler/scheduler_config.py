"""The step scheduler's settings: batch size and token budget, batching mode, admission policy.

The batching modes and policies are defined here, once, for the whole of carpool: the engine's and the
worker's configurations, the ``--batching`` and ``--policy`` flags and the benchmarks all take these.
The one default policy is ``priority``, what a worker has always run: with every request at the same
priority it admits and preempts exactly as ``fcfs`` does (arrival order, no preemption for priority), so
``Engine.generate``, which gives every prompt priority 0, runs as it did under ``fcfs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BatchingMode(StrEnum):
    CONTINUOUS = "continuous"
    """Requests join and leave the running batch at every step."""
    DYNAMIC = "dynamic"
    """A group is admitted once the batch is full or the oldest waiter has waited ``max_wait_ms``."""
    STATIC = "static"
    """A group is admitted only when the running set is empty, and runs until its longest member ends."""


class Policy(StrEnum):
    FCFS = "fcfs"
    """Arrival order; nobody is preempted for priority."""
    PRIORITY = "priority"
    """Lower priority numbers first; a waiting request may preempt running ones of strictly lower priority."""
    SJF = "sjf"
    """Shortest job (prompt + max_tokens) first."""


BATCHING_MODES = tuple(BatchingMode)
POLICIES = tuple(Policy)
DEFAULT_BATCHING = BatchingMode.CONTINUOUS
DEFAULT_POLICY = Policy.PRIORITY


def batching_mode(value: str) -> BatchingMode:
    """``value`` as a batching mode; ValueError naming the setting otherwise."""
    try:
        return BatchingMode(value)
    except ValueError:
        raise ValueError(f"batching: must be one of {', '.join(BATCHING_MODES)}, got {value!r}") from None


def policy(value: str) -> Policy:
    """``value`` as a policy; ValueError naming the setting otherwise."""
    try:
        return Policy(value)
    except ValueError:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {value!r}") from None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    batching: BatchingMode = DEFAULT_BATCHING
    policy: Policy = DEFAULT_POLICY
    max_wait_ms: float = 20.0
    prefill_alone_priority: int | None = None
    """Under the ``priority`` policy in continuous batching: a waiting sequence whose priority number is at most
    this is prefilled in a step that leaves out running sequences of a higher number (their decodes wait that
    one step), so its first token does not wait on their work. None: never."""
    lower_prefill_tokens: int | None = None
    """With ``prefill_alone_priority`` set: the most prompt tokens the running and waiting sequences of a higher
    priority number prefill in one step, new admissions and continued chunks together (their decodes are not
    counted). It bounds how long one step runs while a batch refills its slots, and so how long an urgent request
    arriving meanwhile waits for that step to end. None: only ``max_num_batched_tokens`` bounds them."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        # A plain string naming a mode or policy is accepted and kept as its enum member.
        object.__setattr__(self, "batching", batching_mode(self.batching))
        object.__setattr__(self, "policy", policy(self.policy))
        if self.prefill_alone_priority is not None and (
                isinstance(self.prefill_alone_priority, bool) or not isinstance(self.prefill_alone_priority, int)):
            raise ValueError(f"prefill_alone_priority: must be an integer or None, got {self.prefill_alone_priority!r}")
        if self.lower_prefill_tokens is not None and (
                isinstance(self.lower_prefill_tokens, bool) or not isinstance(self.lower_prefill_tokens, int)
                or self.lower_prefill_tokens < 1):
            raise ValueError(f"lower_prefill_tokens: must be a positive integer or None, got {self.lower_prefill_tokens!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms: must be >= 0, got {self.max_wait_ms!r}")
