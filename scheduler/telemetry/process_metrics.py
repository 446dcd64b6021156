"""What the metrics of every carpool process share: its telemetry, the lane gauges, exposition."""

from __future__ import annotations

from typing import Any

from scheduler.protocol.keys import Keys
from scheduler.protocol.worker_heartbeats import DEFAULT_HEARTBEAT_MAX_AGE_S
from scheduler.telemetry import metric_schema
from scheduler.telemetry.otel import Telemetry, TelemetryConfig
from scheduler.telemetry.stream_stats import DEFAULT_POLL_INTERVAL_S, StreamStats


class ProcessMetrics:
    """Base of ``GatewayMetrics`` and ``WorkerMetrics``.

    Uses the given ``Telemetry`` (its owner shuts it down) or makes its own
    under ``service_name`` (then ``close`` shuts it down).
    """

    def __init__(self, telemetry: Telemetry | None, service_name: str) -> None:
        self._owns_telemetry = telemetry is None
        self.telemetry = telemetry or Telemetry(TelemetryConfig(service_name=service_name))
        self.tracer = self.telemetry.tracer
        self.streams: StreamStats | None = None

    def watch_streams(self, redis: Any, keys: Keys, *, interval_s: float = DEFAULT_POLL_INTERVAL_S,
                      heartbeat_max_age_s: float = DEFAULT_HEARTBEAT_MAX_AGE_S) -> StreamStats:
        """Start the lane/dead-letter gauges; the caller awaits ``streams.aclose()`` at shutdown.
        `heartbeat_max_age_s`: how old a worker's heartbeat may be for the entries it holds to count as held."""
        assert self.streams is None, "streams already watched"
        self.streams = StreamStats(redis, keys, interval_s=interval_s, heartbeat_max_age_s=heartbeat_max_age_s)
        self.telemetry.observable(metric_schema.QUEUE_DEPTH, self.streams.observe_depth)
        self.telemetry.observable(metric_schema.QUEUE_PENDING, self.streams.observe_pending)
        self.telemetry.observable(metric_schema.QUEUE_UNHELD, self.streams.observe_unheld)
        self.telemetry.observable(metric_schema.DEAD_LETTER_DEPTH, self.streams.observe_dead)
        self.streams.start()
        return self.streams

    def render(self) -> bytes:
        return self.telemetry.render_metrics()

    def close(self) -> None:
        """Shut the telemetry down if this object made it (a passed-in one stays its owner's)."""
        if self._owns_telemetry:
            self.telemetry.shutdown()
