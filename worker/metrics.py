"""The worker's instruments, the spans of a job's life on the worker, and the ``/metrics`` handler.

Recording is cheap and thread-safe (OpenTelemetry SDK instruments), and the
engine gauges read a snapshot of ``Engine.stats()`` taken after each step, so
a scrape never touches the engine while its thread is stepping.

A job's trace continues the ``traceparent`` of its message: a
``carpool.queue_wait`` span (enqueue to pick-up) and a ``carpool.job`` consumer
span (pick-up to committed result) whose children are ``carpool.admission``
(pick-up until handed to the engine), ``carpool.prefill`` (engine queue and
prompt until the first token), ``carpool.decode`` (first token to the last)
and ``carpool.result.publish`` (the atomic result commit).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from scheduler.protocol.job import TERMINAL_STATUSES, JobSpec, JobStatus
from scheduler.protocol.lanes import LANES
from scheduler.protocol.tenants import DEFAULT_MAX_TENANT_LABELS, DEFAULT_TENANT, TenantLabels
from scheduler.telemetry import metric_schema
from scheduler.telemetry.otel import (
    PROMETHEUS_CONTENT_TYPE,
    Telemetry,
    context_from_traceparent,
    s_to_ns,
)
from scheduler.telemetry.process_metrics import ProcessMetrics
from worker.engine.records import EngineStats
from worker.job_trace import JobTrace

if TYPE_CHECKING:
    from worker.job_store import Outcome

A_JOB_ID = "carpool.job.id"
DEAD_LETTER_REASONS = ("no_job_field", "invalid_job", "too_many_deliveries", "duplicate_entry", "unadmittable")
"""Every `carpool.dead_letter.reason` the worker records; each is exported at 0 from start-up."""
IDLE_ENGINE = EngineStats(num_running=0, num_waiting=0, num_kv_blocks=0, num_kv_blocks_used=0, kv_usage=0.0,
                          num_preemptions=0, num_priority_preemptions=0, prefix_cache_query_tokens=0,
                          prefix_cache_hit_tokens=0, num_steps=0, last_step_num_tokens=0, last_step_num_seqs=0,
                          last_step_s=0.0)
"""An engine's counters before its first step."""


class WorkerMetrics(ProcessMetrics):
    def __init__(self, telemetry: Telemetry | None = None, *, max_num_seqs: int = 1,
                 max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        assert max_num_seqs >= 1
        super().__init__(telemetry, "carpool-worker")
        self.max_num_seqs = max_num_seqs
        self.tenant_labels = TenantLabels(max_tenant_labels)
        t = self.telemetry
        self._tenant_jobs = t.counter(metric_schema.TENANT_JOBS)
        self._tenant_prompt = t.counter(metric_schema.TENANT_PROMPT_TOKENS)
        self._tenant_completion = t.counter(metric_schema.TENANT_COMPLETION_TOKENS)
        self._tenant_wait = t.histogram(metric_schema.TENANT_QUEUE_WAIT)
        self._finished = t.counter(metric_schema.JOBS_FINISHED)
        self._queue_wait = t.histogram(metric_schema.QUEUE_WAIT)
        self._ttft = t.histogram(metric_schema.TIME_TO_FIRST_TOKEN)
        self._tpot = t.histogram(metric_schema.TIME_PER_OUTPUT_TOKEN)
        self._itl = t.histogram(metric_schema.INTER_TOKEN_LATENCY)
        self._lane_attributes = {lane.value: {metric_schema.A_LANE: lane.value} for lane in LANES}  # read-only once built
        self._e2e = t.histogram(metric_schema.REQUEST_DURATION)
        self._tokens = t.histogram(metric_schema.TOKEN_USAGE)
        self._step_s = t.histogram(metric_schema.STEP_DURATION)
        self._step_tokens = t.histogram(metric_schema.STEP_TOKENS)
        self._reclaimed = t.counter(metric_schema.LEASES_RECLAIMED)
        self._dead = t.counter(metric_schema.DEAD_LETTERED)
        # The engine's last (replaced whole, never mutated); before its first step, an engine that has run nothing:
        # an idle worker reports its engine's gauges at zero, not no series at all.
        self._stats: EngineStats | None = IDLE_ENGINE
        self._last_step = 0
        for spec, read in (
            (metric_schema.SEQS_RUNNING, lambda s: s.num_running),
            (metric_schema.SEQS_WAITING, lambda s: s.num_waiting),
            (metric_schema.KV_CACHE_USAGE, lambda s: s.kv_usage),
            (metric_schema.BATCH_OCCUPANCY, lambda s: s.num_running / self.max_num_seqs),
            (metric_schema.PREEMPTIONS, lambda s: s.num_preemptions),
            (metric_schema.PREFIX_CACHE_QUERIES, lambda s: s.prefix_cache_query_tokens),
            (metric_schema.PREFIX_CACHE_HITS, lambda s: s.prefix_cache_hit_tokens),
            (metric_schema.PREFIX_CACHE_HIT_RATE, _hit_rate),
        ):
            t.observable(spec, self._observer(read))
        for spec, read in (
            (metric_schema.SPEC_DRAFTS, lambda s: s.spec_num_drafts),
            (metric_schema.SPEC_PROPOSED, lambda s: s.spec_proposed_tokens),
            (metric_schema.SPEC_ACCEPTED, lambda s: s.spec_accepted_tokens),
            (metric_schema.SPEC_MEAN_ACCEPTED_LENGTH, _mean_accepted_length),
        ):
            t.observable(spec, self._spec_observer(read))
        for lane in LANES:
            self._reclaimed.add(0, {metric_schema.A_LANE: lane.value})
            for reason in DEAD_LETTER_REASONS:
                self._dead.add(0, {metric_schema.A_LANE: lane.value, metric_schema.A_DEAD_LETTER_REASON: reason})
            for status in sorted(TERMINAL_STATUSES):
                self._finished.add(0, {metric_schema.A_LANE: lane.value, metric_schema.A_JOB_STATUS: status.value})

    # --- engine ------------------------------------------------------------------------

    def record_step(self, stats: Any) -> None:
        """Take the engine's ``EngineStats`` after a tick; records the step if one ran."""
        self._stats = stats
        if stats.num_steps > self._last_step:
            self._last_step = stats.num_steps
            self._step_s.record(stats.last_step_s)
            self._step_tokens.record(stats.last_step_num_tokens)

    def _observer(self, read: Any) -> Any:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            stats = self._stats
            return [] if stats is None else [Observation(read(stats))]

        return observe

    def _spec_observer(self, read: Any) -> Any:
        """Speculative decoding's series, labelled by proposer; none while the engine does not speculate."""
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            stats = self._stats
            proposer = None if stats is None else stats.spec_proposer
            return [] if proposer is None else [Observation(read(stats), {metric_schema.A_SPEC_PROPOSER: proposer})]

        return observe

    def tokens_emitted(self, lane: str, gap_s: float | None, num_tokens: int) -> None:
        """A step gave a sequence ``num_tokens`` new tokens, ``gap_s`` after its previous token (None: its first).

        One inter-token sample per token after the first: the first new token
        waited ``gap_s``, the others of the same step came with it (gap 0).
        """
        attributes = self._lane_attributes.get(lane) or {metric_schema.A_LANE: lane}
        if gap_s is not None:
            self._itl.record(max(0.0, gap_s), attributes)
        for _ in range(num_tokens - 1):
            self._itl.record(0.0, attributes)

    # --- jobs ----------------------------------------------------------------------------

    def job_started(self, spec: JobSpec, created_s: float, now_s: float | None = None, *, resumed_from: int = 0) -> JobTrace:
        """A job was picked up to run: records its queue wait and opens its spans."""
        now_s = time.time() if now_s is None else now_s
        lane = spec.lane.value
        created_s = min(created_s, now_s)
        self._queue_wait.record(now_s - created_s, {metric_schema.A_LANE: lane})
        tenant = self.tenant_labels.label(spec.tenant)
        self._tenant_wait.record(now_s - created_s, {metric_schema.A_TENANT: tenant, metric_schema.A_LANE: lane})
        parent = context_from_traceparent(spec.traceparent)
        attributes = {A_JOB_ID: spec.id, metric_schema.A_LANE: lane}
        span = self.tracer.start_span(
            "carpool.job", context=parent, kind=SpanKind.CONSUMER,
            attributes={**attributes, "carpool.job.resumed_from": resumed_from}, start_time=s_to_ns(now_s),
        )
        # Beside the job's span under the producer's context; a job that came with none starts its trace here,
        # and its wait joins that trace under the job's span rather than being a trace of its own.
        self.tracer.start_span(
            "carpool.queue_wait", context=parent if parent is not None else trace.set_span_in_context(span),
            kind=SpanKind.INTERNAL, attributes=attributes, start_time=s_to_ns(created_s),
        ).end(end_time=s_to_ns(now_s))
        return JobTrace(spec.id, lane, tenant, created_s, now_s, span, resumed_from=resumed_from, attributes=attributes)

    @contextmanager
    def publish_span(self, job: JobTrace | None) -> Iterator[None]:
        """Span around committing a job's result (record, pub/sub, reply stream, XACK, webhook)."""
        if job is None:
            yield
            return
        with self.tracer.start_as_current_span(
            "carpool.result.publish", context=trace.set_span_in_context(job.span), attributes=job.attributes
        ):
            yield

    def job_finished(
        self, job: JobTrace, status: JobStatus, *, prompt_tokens: int, completion_tokens: int,
        first_token_s: float | None, now_s: float | None = None,
    ) -> None:
        """The job's result is committed: closes its spans and records its latencies and tokens."""
        now_s = time.time() if now_s is None else now_s
        lane = {metric_schema.A_LANE: job.lane}
        self._finished.add(1, {**lane, metric_schema.A_JOB_STATUS: status.value})
        self._e2e.record(now_s - job.created_s, {**lane, metric_schema.A_JOB_STATUS: status.value})
        if prompt_tokens or completion_tokens:  # none for a job stopped before its engine took a step of it
            self._tokens.record(prompt_tokens, {**lane, metric_schema.A_TOKEN_TYPE: "input"})
            self._tokens.record(completion_tokens, {**lane, metric_schema.A_TOKEN_TYPE: "output"})
        tenant = {metric_schema.A_TENANT: job.tenant}
        self._tenant_jobs.add(1, {**tenant, metric_schema.A_JOB_STATUS: status.value})
        self._tenant_prompt.add(prompt_tokens, tenant)
        self._tenant_completion.add(completion_tokens, tenant)
        generated_here = completion_tokens - job.resumed_from
        if status == JobStatus.SUCCEEDED and first_token_s is not None:
            self._ttft.record(max(0.0, first_token_s - job.created_s), lane)
            if generated_here > 1:
                self._tpot.record(max(0.0, now_s - first_token_s) / (generated_here - 1), lane)
        self._phase_spans(job, first_token_s, now_s)
        job.span.set_attribute(metric_schema.A_JOB_STATUS, status.value)
        job.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        job.span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if status == JobStatus.FAILED:
            job.span.set_status(Status(StatusCode.ERROR))
        job.span.end(end_time=s_to_ns(now_s))

    def job_committed(self, outcome: Outcome, won: bool) -> None:
        """Close a job that ran here once its outcome is committed (``won``: this commit decided it)."""
        job = outcome.trace
        assert isinstance(job, JobTrace)
        if not won:  # decided elsewhere (another worker, a cancel): its metrics were counted there
            job.span.set_attribute("carpool.job.superseded", True)
            job.span.end()
            return
        usage = outcome.usage or {}
        self.job_finished(
            job, outcome.status, prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)), first_token_s=outcome.first_token_at,
        )

    def _phase_spans(self, job: JobTrace, first_token_s: float | None, end_s: float) -> None:
        parent = trace.set_span_in_context(job.span)
        admitted_s = job.admitted_s if job.admitted_s is not None else job.started_s
        phases = [("carpool.admission", job.started_s, admitted_s)]
        if first_token_s is not None and first_token_s >= admitted_s:
            phases += [("carpool.prefill", admitted_s, first_token_s), ("carpool.decode", first_token_s, end_s)]
        else:
            phases.append(("carpool.prefill", admitted_s, end_s))
        for name, start_s, stop_s in phases:
            self.tracer.start_span(name, context=parent, attributes=job.attributes, start_time=s_to_ns(start_s)).end(
                end_time=s_to_ns(max(start_s, stop_s))
            )

    def job_finished_unrun(self, lane: str, status: JobStatus, created_s: float, now_s: float | None = None, *,
                           tenant: str = DEFAULT_TENANT) -> None:
        """A job decided without running (expired, cancelled while queued, invalid, dead-lettered)."""
        now_s = time.time() if now_s is None else now_s
        self._tenant_jobs.add(1, {metric_schema.A_TENANT: self.tenant_labels.label(tenant), metric_schema.A_JOB_STATUS: status.value})
        self._finished.add(1, {metric_schema.A_LANE: lane, metric_schema.A_JOB_STATUS: status.value})
        self._e2e.record(max(0.0, now_s - created_s), {metric_schema.A_LANE: lane, metric_schema.A_JOB_STATUS: status.value})

    def leases_reclaimed(self, lanes: Iterable[str]) -> None:
        for lane in lanes:
            self._reclaimed.add(1, {metric_schema.A_LANE: lane})

    def dead_lettered(self, lane: str, reason: str) -> None:
        self._dead.add(1, {metric_schema.A_LANE: lane, metric_schema.A_DEAD_LETTER_REASON: reason})



def _mean_accepted_length(stats: Any) -> float:
    drafts = stats.spec_num_drafts
    return 1.0 + stats.spec_accepted_tokens / drafts if drafts else 0.0


def _hit_rate(stats: Any) -> float:
    queried = stats.prefix_cache_query_tokens
    return stats.prefix_cache_hit_tokens / queried if queried else 0.0


METRICS_KEY = web.AppKey("worker_metrics", WorkerMetrics)


async def metrics_handler(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})
