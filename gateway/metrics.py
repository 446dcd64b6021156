"""The gateway's Prometheus metrics, one registry per app (two apps in a process never mix)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.jobs_submitted = Counter(
            "carpool_gateway_jobs_submitted", "Jobs enqueued by this gateway", ["lane"], registry=self.registry
        )
        self.jobs_deduplicated = Counter(
            "carpool_gateway_jobs_deduplicated",
            "Submissions answered with an existing job (reused id or Idempotency-Key)",
            registry=self.registry,
        )
        self.jobs_rejected = Counter(
            "carpool_gateway_jobs_rejected", "Submissions refused", ["reason"], registry=self.registry
        )
        self.jobs_cancelled = Counter(
            "carpool_gateway_jobs_cancelled", "Cancellations accepted", ["state"], registry=self.registry
        )
        self.open_waiters = Gauge(
            "carpool_gateway_open_waiters", "Long-polls and event streams waiting on a job", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
