"""Webhook delivery telemetry: attempt counts and durations, and one span per attempt in the job's trace.

``WebhookMetrics`` is the dispatcher's ``AttemptObserver``. The gateway holds
one inside its ``GatewayMetrics`` (the in-process dispatcher); ``carpool
webhooks`` builds its own and serves it with ``dispatcher_http_app``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from yarl import URL

from scheduler.protocol.job import WebhookEvent
from scheduler.protocol.webhooks import AttemptOutcome, BatchEvent
from scheduler.telemetry import metric_schema
from scheduler.telemetry.otel import PROMETHEUS_CONTENT_TYPE, Telemetry, context_from_traceparent

WEBHOOK_OUTCOMES = tuple(o.value for o in AttemptOutcome)


class WebhookMetrics:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self._deliveries = telemetry.counter(metric_schema.WEBHOOK_DELIVERIES)
        self._duration = telemetry.histogram(metric_schema.WEBHOOK_DURATION)
        # Zero series for every event and outcome, so rate() sees them before the first attempt.
        for event in (*WebhookEvent, *BatchEvent):
            for outcome in WEBHOOK_OUTCOMES:
                self._deliveries.add(0, {metric_schema.A_WEBHOOK_EVENT: event.value, metric_schema.A_WEBHOOK_OUTCOME: outcome})

    def webhook_attempt(self, event: str, outcome: str, duration_s: float | None = None) -> None:
        self._deliveries.add(1, {metric_schema.A_WEBHOOK_EVENT: event, metric_schema.A_WEBHOOK_OUTCOME: outcome})
        if duration_s is not None:
            self._duration.record(duration_s, {metric_schema.A_WEBHOOK_OUTCOME: outcome})

    @contextmanager
    def webhook_span(self, traceparent: str | None, event: str, url: str) -> Iterator[trace.Span]:
        """Client span of one delivery attempt, a child of the job's trace context when the entry carries one."""
        with self.tracer.start_as_current_span(
            "carpool.webhook.deliver",
            context=context_from_traceparent(traceparent),
            kind=SpanKind.CLIENT,
            attributes={metric_schema.A_WEBHOOK_EVENT: event, "url.full": redacted_url(url)},
        ) as span:
            yield span


REDACTED = "REDACTED"


def redacted_url(url: str) -> str:
    """`url` as a span may carry it: user and password, and every query value, replaced by ``REDACTED`` (a
    receiver's token often rides in the query); scheme, host, port, path and query names kept."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return REDACTED
    if parsed.user is not None or parsed.password is not None:
        parsed = parsed.with_user(REDACTED).with_password(REDACTED)
    if parsed.query_string:
        parsed = parsed.with_query([(name, REDACTED) for name in parsed.query])
    return str(parsed.with_fragment(None))


def dispatcher_http_app(metrics: WebhookMetrics, is_healthy: Callable[[], bool]) -> web.Application:
    """``/metrics`` (Prometheus text) and ``/healthz`` (200 while ``is_healthy()``, else 500) of ``carpool webhooks``."""

    async def render(request: web.Request) -> web.Response:
        return web.Response(body=metrics.telemetry.render_metrics(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        healthy = is_healthy()
        return web.json_response({"status": "ok" if healthy else "failed"}, status=200 if healthy else 500)

    app = web.Application()
    app.router.add_get("/metrics", render)
    app.router.add_get("/healthz", healthz)
    return app
