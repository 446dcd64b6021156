"""The step scheduler's settings: batch size and token budget, batching mode, admission policy."""

from __future__ import annotations

from dataclasses import dataclass

BATCHING_MODES = ("continuous", "dynamic", "static")
POLICIES = ("fcfs", "priority", "sjf")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    batching: str = "continuous"
    policy: str = "fcfs"
    max_wait_ms: float = 20.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching: must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms: must be >= 0, got {self.max_wait_ms!r}")
