"""The gateway's instruments, its HTTP tracing middleware and the ``/metrics`` body.

One ``GatewayMetrics`` per app, built on that process's ``Telemetry`` (its own
meter, tracer and Prometheus registry), so two apps in one process never mix.
Spans: every HTTP request gets a server span continuing an incoming W3C
``traceparent`` header; a submission adds a ``carpool.enqueue`` producer span
whose context travels to the worker in the job message's ``traceparent``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.access_log import id_field, note, status_of
from gateway.webhooks.metrics import WebhookMetrics
from scheduler.protocol.job import JobSpec, JobStatus
from scheduler.protocol.lanes import LANES
from scheduler.protocol.tenants import DEFAULT_MAX_TENANT_LABELS, DEFAULT_TENANT, TenantLabels
from scheduler.telemetry import metric_schema
from scheduler.telemetry.log_format import job_context
from scheduler.telemetry.otel import (
    PROMETHEUS_CONTENT_TYPE,
    Telemetry,
    context_from_traceparent,
    traceparent_of,
)
from scheduler.telemetry.process_metrics import ProcessMetrics

CONTENT_TYPE = PROMETHEUS_CONTENT_TYPE
UNKNOWN_LANE = "unknown"
# Scrapes and probes would drown the job traces; they still count in the duration histogram.
UNTRACED_ROUTES = frozenset({"/metrics", "/healthz", "/readyz"})


class GatewayMetrics(ProcessMetrics):
    def __init__(self, telemetry: Telemetry | None = None, max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        super().__init__(telemetry, "carpool-gateway")
        t = self.telemetry
        self._submitted = t.counter(metric_schema.JOBS_SUBMITTED)
        self._rejected = t.counter(metric_schema.JOBS_REJECTED)
        self._deduplicated = t.counter(metric_schema.JOBS_DEDUPLICATED)
        self._cancelled = t.counter(metric_schema.JOBS_CANCELLED)
        self._finished = t.counter(metric_schema.JOBS_FINISHED)
        self._tenant_jobs = t.counter(metric_schema.TENANT_JOBS)
        self._tenant_labels = TenantLabels(max_tenant_labels)
        self._open_waiters = t.up_down_counter(metric_schema.OPEN_WAITERS)
        self._http_duration = t.histogram(metric_schema.HTTP_SERVER_DURATION)
        self.webhooks = WebhookMetrics(t)
        # Zero series for every known label set, so dashboards and rate() see them before the first event.
        for lane in LANES:
            self._submitted.add(0, {metric_schema.A_LANE: lane.value})
            self._finished.add(0, {metric_schema.A_LANE: lane.value, metric_schema.A_JOB_STATUS: JobStatus.CANCELLED.value})
            for reason in ("lane_full", "rate_limited", "quota", "conflict"):
                self._rejected.add(0, {metric_schema.A_LANE: lane.value, metric_schema.A_REJECT_REASON: reason})
        self._rejected.add(0, {metric_schema.A_LANE: UNKNOWN_LANE, metric_schema.A_REJECT_REASON: "invalid"})
        self._deduplicated.add(0)
        self._open_waiters.add(0)
        for state in ("queued", "running"):
            self._cancelled.add(0, {metric_schema.A_CANCEL_STATE: state})
        self._tenant_jobs.add(0, {metric_schema.A_TENANT: self._tenant_labels.label(DEFAULT_TENANT),
                                  metric_schema.A_JOB_STATUS: JobStatus.CANCELLED.value})

    # --- recording --------------------------------------------------------------------

    def job_submitted(self, lane: str) -> None:
        self._submitted.add(1, {metric_schema.A_LANE: lane})

    def job_rejected(self, reason: str, lane: str | None = None) -> None:
        self._rejected.add(1, {metric_schema.A_LANE: lane or UNKNOWN_LANE, metric_schema.A_REJECT_REASON: reason})

    def job_deduplicated(self) -> None:
        self._deduplicated.add(1)

    def job_cancelled(self, state: str) -> None:
        self._cancelled.add(1, {metric_schema.A_CANCEL_STATE: state})

    def job_cancelled_queued(self, lane: str, tenant: str) -> None:
        """A job that ended here, cancelled while queued: counted among the finished jobs, as a worker counts
        the jobs it ends."""
        status = JobStatus.CANCELLED.value
        self._finished.add(1, {metric_schema.A_LANE: lane, metric_schema.A_JOB_STATUS: status})
        self._tenant_jobs.add(1, {metric_schema.A_TENANT: self._tenant_labels.label(tenant),
                                  metric_schema.A_JOB_STATUS: status})

    def waiter_opened(self) -> None:
        """A long-poll or event stream started waiting on a job (pair with ``waiter_closed``)."""
        self._open_waiters.add(1)

    def waiter_closed(self) -> None:
        self._open_waiters.add(-1)

    def record_http(self, duration_s: float, attributes: dict[str, Any]) -> None:
        self._http_duration.record(duration_s, attributes)

    def webhook_attempt(self, event: str, outcome: str, duration_s: float | None = None) -> None:
        self.webhooks.webhook_attempt(event, outcome, duration_s)

    # --- tracing ----------------------------------------------------------------------

    @contextmanager
    def enqueue_span(self, spec: JobSpec, linked: str | None = None) -> Iterator[Callable[[str], None]]:
        """Span around putting a job on its lane; sets ``spec.traceparent`` so the worker continues it, and
        yields what takes the enqueue's verdict: its ``carpool.enqueue.outcome`` attribute (``enqueued``, or a
        repeat, ``exists`` or ``claimed``, the job already there, or ``taken``, the id another tenant's), and the
        span's error where the lane or the tenant's quota refused it (``full``, ``quota``).

        A ``traceparent`` the producer put in the body is the parent, and the span links to the current one (the
        HTTP server span), so that the request's trace leads to the job's; otherwise the current context is the
        parent (the HTTP server span, itself continuing any incoming ``traceparent`` header). ``linked``: the
        traceparent of the work that made the job without being its parent (the request that created a Batch API
        line's batch), which the span links to: each line keeps a trace of its own, and each trace leads to the
        batch's.
        """
        parent = context_from_traceparent(spec.traceparent)
        attributes = {"carpool.job.id": spec.id, metric_schema.A_LANE: spec.lane.value}
        link_context = context_from_traceparent(linked)
        links = [] if link_context is None else [trace.Link(trace.get_current_span(link_context).get_span_context())]
        current = trace.get_current_span().get_span_context()
        if parent is not None and current.is_valid:
            links.append(trace.Link(current))
        with self.tracer.start_as_current_span(
            "carpool.enqueue", context=parent, kind=SpanKind.PRODUCER, attributes=attributes, links=links
        ) as span:
            spec.traceparent = traceparent_of(span)

            def say_verdict(verdict: str) -> None:
                span.set_attribute("carpool.enqueue.outcome", verdict)
                if verdict in ("full", "quota"):
                    span.set_status(Status(StatusCode.ERROR, "the lane is full" if verdict == "full"
                                           else "the tenant's max_queued is reached"))

            with job_context(spec.id):
                yield say_verdict

    def webhook_span(self, traceparent: str | None, event: str, url: str) -> AbstractContextManager[trace.Span]:
        """Client span of one webhook delivery attempt, in the trace of the job it reports on."""
        return self.webhooks.webhook_span(traceparent, event, url)



Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# aiohttp 3.14 types a request's own keys (and warns of plain strings); older releases take a string.
REQUEST_ID_KEY: Any = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "carpool.request_id"
"""Where a request keeps the id its answer carries as `x-request-id`, made the first time it is asked for."""


def request_id(request: web.Request) -> str:
    """The request's id (``req_`` and 32 hex digits), new for each request: its answer's `x-request-id`, and an
    attribute of its span, so that an id a client reports finds the trace."""
    found = request.get(REQUEST_ID_KEY)
    if found is None:
        found = request[REQUEST_ID_KEY] = "req_" + secrets.token_hex(16)
    return str(found)


def telemetry_middleware(metrics: GatewayMetrics) -> Middleware:
    """The middleware recording into ``metrics``: a server span (continuing a ``traceparent`` header) and
    the duration histogram for every request."""

    @web.middleware
    async def telemetry(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await _record_request(metrics, request, handler)

    return telemetry


async def _record_request(metrics: GatewayMetrics, request: web.Request, handler: Handler) -> web.StreamResponse:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    attributes: dict[str, Any] = {metric_schema.A_HTTP_METHOD: request.method, metric_schema.A_HTTP_ROUTE: route}
    start = time.perf_counter()
    status = 500
    if route in UNTRACED_ROUTES:
        span_cm: Any = nullcontext(None)
    else:
        span_cm = metrics.tracer.start_as_current_span(
            f"{request.method} {route}",
            context=context_from_traceparent(request.headers.get("traceparent"), request.headers.get("tracestate")),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
    subject = request.match_info.get("id")
    field = id_field(route) if subject else None
    if subject and field:
        note(request, **{field: subject})
    job_id = subject if field == "job_id" else None
    with span_cm as span, (job_context(job_id) if job_id else nullcontext()):
        if span is not None:
            # The id the answer will carry (`x-request-id`): a client's report of it finds this trace.
            span.set_attribute(metric_schema.A_HTTP_REQUEST_ID, request_id(request))
            note(request, trace_id=format(span.get_span_context().trace_id, "032x"))
        try:
            response = await handler(request)
            status = status_of(request, response)
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            metrics.record_http(time.perf_counter() - start, {**attributes, metric_schema.A_HTTP_STATUS: status})
            if span is not None:
                span.set_attribute(metric_schema.A_HTTP_STATUS, status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))

