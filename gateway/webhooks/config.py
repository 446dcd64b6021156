"""Webhook dispatcher settings: one dataclass, turned into flags by `scheduler.runtime.flags.add_config_flags`."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.webhooks.safety import Allowlist
from gateway.webhooks.signing import parse_secret
from scheduler.protocol.keys import DEFAULT_RESULT_TTL_S
from scheduler.protocol.webhooks import (
    DEFAULT_JITTER_FRACTION,
    DEFAULT_MAX_RETRY_AFTER_S,
    DEFAULT_RETRY_SCHEDULE_S,
    DEFAULT_TIMEOUT_S,
    RetryPolicy,
)


@dataclass
class WebhookConfig:
    webhook_secret: str | None = field(
        default=None,
        metadata={"help": "signing secret, whsec_<base64>; without it jobs asking for a webhook are refused"},
    )
    webhook_allow: list[str] = field(
        default_factory=list,
        metadata={"help": "non-public hosts or CIDRs webhooks may reach anyway, comma-separated"},
    )
    webhook_timeout_s: float = field(default=DEFAULT_TIMEOUT_S, metadata={"help": "seconds one delivery attempt may take"})
    webhook_retry_schedule_s: list[float] = field(
        default_factory=lambda: list(DEFAULT_RETRY_SCHEDULE_S),
        metadata={"help": "seconds before each retry, comma-separated; the last one repeats"},
    )
    webhook_max_attempts: int | None = field(
        default=None,
        metadata={"help": "attempts before a delivery is dead-lettered (default: one more than the schedule's length)"},
    )
    webhook_jitter: float = field(
        default=DEFAULT_JITTER_FRACTION, metadata={"help": "each retry delay is scaled by a random factor in [1-j, 1+j]"}
    )
    webhook_max_retry_after_s: float = field(
        default=DEFAULT_MAX_RETRY_AFTER_S, metadata={"help": (
            "longest Retry-After (on 429/503) that is honoured; a Retry-After lengthens the schedule's delay, "
            "never shortens it")}
    )
    webhook_concurrency: int = field(default=64, metadata={"help": "deliveries one dispatcher sends at the same time"})
    webhook_poll_s: float = field(default=0.25, metadata={"help": "how often an idle dispatcher looks for new and due deliveries"})
    webhook_drain_s: float = field(default=5.0, metadata={"help": "on shutdown, seconds to let in-flight attempts finish"})
    webhook_ttl_s: int = field(
        default=DEFAULT_RESULT_TTL_S, metadata={"help": "seconds a finished delivery's state is kept in Redis"}
    )

    def __post_init__(self) -> None:
        if self.webhook_secret is not None:
            parse_secret(self.webhook_secret)
        self.allowlist()
        self.retry_policy()
        for name in ("webhook_timeout_s", "webhook_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not self.webhook_drain_s >= 0:
            raise ValueError(f"webhook_drain_s: must not be negative, got {self.webhook_drain_s}")
        if self.webhook_concurrency < 1:
            raise ValueError(f"webhook_concurrency: must be at least 1, got {self.webhook_concurrency}")

    def allowlist(self) -> Allowlist:
        return Allowlist.parse(self.webhook_allow)

    def retry_policy(self) -> RetryPolicy:
        schedule = tuple(float(d) for d in self.webhook_retry_schedule_s)
        max_attempts = self.webhook_max_attempts if self.webhook_max_attempts is not None else len(schedule) + 1
        return RetryPolicy(
            schedule_s=schedule,
            max_attempts=max_attempts,
            jitter_fraction=self.webhook_jitter,
            max_retry_after_s=self.webhook_max_retry_after_s,
        )

    def signing_key(self) -> bytes | None:
        return None if self.webhook_secret is None else parse_secret(self.webhook_secret)
