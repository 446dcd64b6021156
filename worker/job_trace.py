"""One job's run on this worker, as its spans and metrics see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from scheduler.telemetry.otel import traceparent_of

@dataclass
class JobTrace:
    """One job's run on this worker: its lane, timestamps (unix s) and open ``carpool.job`` span."""

    job_id: str
    lane: str
    tenant: str
    """The tenant's metric label (capped)."""
    created_s: float
    started_s: float
    span: trace.Span
    admitted_s: float | None = None
    resumed_from: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def traceparent(self) -> str | None:
        """Parent for work this job causes elsewhere (webhook deliveries)."""
        return traceparent_of(self.span)

    def admitted(self, now_s: float) -> None:
        if self.admitted_s is None:
            self.admitted_s = now_s
