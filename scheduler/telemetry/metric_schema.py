"""Every metric carpool exports, as data: OpenTelemetry name, kind, unit, attributes.

Names follow OpenTelemetry's semantic conventions where one exists (the GenAI
conventions for token usage, time to first token, time per output token and
request duration; the HTTP one for server request duration) and sit under
``carpool.*`` otherwise. ``MetricSpec.prometheus_names`` gives the series a
Prometheus scrape shows for each (the exporter's translation: dots become
underscores, the unit is appended as a word, counters end in ``_total``,
histograms expose ``_bucket`` / ``_sum`` / ``_count``), which is what the
Grafana dashboard queries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

InstrumentKind = Literal["counter", "up_down_counter", "histogram", "observable_gauge", "observable_counter"]

# Attribute names (Prometheus labels: dots become underscores, e.g. carpool_lane).
A_LANE = "carpool.lane"
A_JOB_STATUS = "carpool.job.status"
A_REJECT_REASON = "carpool.reject.reason"
A_CANCEL_STATE = "carpool.cancel.state"  # "queued" | "running"
A_DEAD_LETTER_REASON = "carpool.dead_letter.reason"
A_WEBHOOK_EVENT = "carpool.webhook.event"
A_WEBHOOK_OUTCOME = "carpool.webhook.outcome"
A_TENANT = "carpool.tenant"  # capped: past --max-tenant-labels distinct tenants, "_other"
A_TOKEN_TYPE = "gen_ai.token.type"  # "input" | "output"
A_SPEC_PROPOSER = "carpool.spec_decode.proposer"  # "ngram" | "draft"
A_HTTP_METHOD = "http.request.method"
A_HTTP_ROUTE = "http.route"
A_HTTP_STATUS = "http.response.status_code"
A_HTTP_REQUEST_ID = "http.response.header.x-request-id"
"""The id the gateway names each answer by (its `x-request-id` header): on the request's span (traces only)."""

# Bucket boundaries advised by the semantic conventions where they give some, extended past them where a job's
# times count its wait in the lane: a batch-lane job may wait hours of its 24 h window, and a quantile cannot
# rise above the last finite boundary.
_HOURS_S = (1800.0, 3600.0, 7200.0, 21600.0, 43200.0, 86400.0)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  30.0, 60.0, 300.0, *_HOURS_S)
# Per-token gaps sit well below per-request latencies; finer at the bottom than the TPOT advice.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
                      300.0, 900.0, *_HOURS_S)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, *_HOURS_S)
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_USAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Past the advice's 10 s: long-polls (up to --max-wait-s, 60 s by default) and streamed answers last longer.
HTTP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
                  300.0, 1800.0)

# The Prometheus exporter's unit words (UCUM annotations in braces are dropped, "1" adds nothing).
_UNIT_WORDS = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": "", "%": "percent"}


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: InstrumentKind
    unit: str
    description: str
    attributes: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def check_kind(self, kind: InstrumentKind) -> None:
        assert self.kind == kind, f"{self.name} is declared a {self.kind}, not a {kind}"

    @property
    def prometheus_name(self) -> str:
        """The family name on ``/metrics``: ``gen_ai.server.time_to_first_token`` -> ``..._seconds``."""
        name = re.sub(r"[^a-zA-Z0-9:]+", "_", self.name)
        word = re.sub(r"\{.*\}", "", self.unit)
        word = _UNIT_WORDS.get(word, re.sub(r"[^a-zA-Z0-9:]+", "_", word).strip("_"))
        if word and not name.endswith("_" + word):
            name = f"{name}_{word}"
        return name

    @property
    def prometheus_names(self) -> tuple[str, ...]:
        """Every sample name the family shows in Prometheus text."""
        base = self.prometheus_name
        if self.kind in ("counter", "observable_counter"):
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


# --- gateway process -----------------------------------------------------------------

JOBS_SUBMITTED = MetricSpec(
    "carpool.jobs.submitted", "counter", "{job}", "Jobs accepted by the gateway and enqueued on a lane.", (A_LANE,)
)
JOBS_REJECTED = MetricSpec(
    "carpool.jobs.rejected", "counter", "{job}",
    "Submissions refused: invalid body (invalid), full lane (lane_full), a tenant's rate limit (rate_limited) or "
    "queued-jobs maximum (quota).", (A_LANE, A_REJECT_REASON),
)
JOBS_DEDUPLICATED = MetricSpec(
    "carpool.jobs.deduplicated", "counter", "{job}",
    "Submissions answered with a job that already existed (reused id or Idempotency-Key).",
)
JOBS_CANCELLED = MetricSpec(
    "carpool.jobs.cancelled", "counter", "{job}", "Cancellations accepted, by the job's state at the time.",
    (A_CANCEL_STATE,),
)
OPEN_WAITERS = MetricSpec(
    "carpool.gateway.open_waiters", "up_down_counter", "{request}",
    "Long-polls and event streams currently waiting on a job.",
)
HTTP_SERVER_DURATION = MetricSpec(
    "http.server.request.duration", "histogram", "s", "Duration of HTTP server requests.",
    (A_HTTP_METHOD, A_HTTP_ROUTE, A_HTTP_STATUS), HTTP_BUCKETS_S,
)
WEBHOOK_DELIVERIES = MetricSpec(
    "carpool.webhook.deliveries", "counter", "{delivery}",
    "Webhook delivery attempts by event (a job's started, output, completed; a batch's batch.completed, "
    "batch.failed, batch.expired, batch.cancelled) and outcome: delivered, retrying, gone (receiver answered 410), "
    "dead (retries exhausted).",
    (A_WEBHOOK_EVENT, A_WEBHOOK_OUTCOME),
)
WEBHOOK_DURATION = MetricSpec(
    "carpool.webhook.delivery.duration", "histogram", "s", "Duration of one webhook delivery attempt.",
    (A_WEBHOOK_OUTCOME,), HTTP_BUCKETS_S,
)

# --- read from the streams (both processes) --------------------------------------------

QUEUE_DEPTH = MetricSpec(
    "carpool.queue.depth", "observable_gauge", "{job}",
    "Entries in a lane: its stream and its tenants' streams (XLEN).", (A_LANE,)
)
QUEUE_PENDING = MetricSpec(
    "carpool.queue.pending", "observable_gauge", "{job}",
    "Entries of a lane (its stream and its tenants') delivered to a worker and not yet acknowledged (XPENDING).",
    (A_LANE,),
)
QUEUE_UNHELD = MetricSpec(
    "carpool.queue.unheld", "observable_gauge", "{job}",
    "Of a lane's pending entries, those delivered to a worker whose heartbeat stopped (killed, or handed back at "
    "its drain): they wait for another worker's reclaim, as undelivered ones wait for a read.", (A_LANE,),
)
DEAD_LETTER_DEPTH = MetricSpec(
    "carpool.dead_letter.depth", "observable_gauge", "{entry}", "Entries in the dead-letter stream (XLEN)."
)

# --- worker process --------------------------------------------------------------------

JOBS_FINISHED = MetricSpec(
    "carpool.jobs.finished", "counter", "{job}",
    "Jobs that reached a final status (succeeded, failed, cancelled, expired).", (A_LANE, A_JOB_STATUS),
)
QUEUE_WAIT = MetricSpec(
    "carpool.job.queue_wait", "histogram", "s", "Time from submission until a worker started the job.",
    (A_LANE,), QUEUE_WAIT_BUCKETS_S,
)
TIME_TO_FIRST_TOKEN = MetricSpec(
    "gen_ai.server.time_to_first_token", "histogram", "s",
    "Time from submission to the first generated token, for successful jobs.", (A_LANE,), TTFT_BUCKETS_S,
)
TIME_PER_OUTPUT_TOKEN = MetricSpec(
    "gen_ai.server.time_per_output_token", "histogram", "s",
    "Mean inter-token latency of a successful job: decode time over output tokens after the first.",
    (A_LANE,), TPOT_BUCKETS_S,
)
INTER_TOKEN_LATENCY = MetricSpec(
    "carpool.inter_token_latency", "histogram", "s",
    "Gap between consecutive output tokens of a sequence, one sample per token after the first.",
    (A_LANE,), ITL_BUCKETS_S,
)
REQUEST_DURATION = MetricSpec(
    "gen_ai.server.request.duration", "histogram", "s", "End-to-end job latency, submission to final status.",
    (A_LANE, A_JOB_STATUS), DURATION_BUCKETS_S,
)
TOKEN_USAGE = MetricSpec(
    "gen_ai.client.token.usage", "histogram", "{token}",
    "Prompt (input) and generated (output) tokens of each job that ran (a job ended before it started has none).",
    (A_LANE, A_TOKEN_TYPE), TOKEN_USAGE_BUCKETS,
)
STEP_DURATION = MetricSpec(
    "carpool.engine.step.duration", "histogram", "s", "Wall time of one engine step (schedule, forward, sample).",
    (), STEP_BUCKETS_S,
)
STEP_TOKENS = MetricSpec(
    "carpool.engine.step.tokens", "histogram", "{token}", "Tokens computed in one engine step (prefill and decode).",
    (), STEP_TOKEN_BUCKETS,
)
SEQS_RUNNING = MetricSpec(
    "carpool.engine.sequences.running", "observable_gauge", "{sequence}", "Sequences in the running batch."
)
SEQS_WAITING = MetricSpec(
    "carpool.engine.sequences.waiting", "observable_gauge", "{sequence}", "Sequences admitted to the engine and waiting."
)
BATCH_OCCUPANCY = MetricSpec(
    "carpool.engine.batch.occupancy", "observable_gauge", "1", "Running sequences over max_num_seqs (0..1)."
)
KV_CACHE_USAGE = MetricSpec(
    "carpool.engine.kv_cache.usage", "observable_gauge", "1", "Fraction of KV-cache blocks in use (0..1)."
)
PREEMPTIONS = MetricSpec(
    "carpool.engine.preemptions", "observable_counter", "{preemption}",
    "Sequences preempted (recomputed later) because KV blocks ran out or to admit a more urgent job at once.",
)
PREFIX_CACHE_HIT_RATE = MetricSpec(
    "carpool.engine.prefix_cache.hit_rate", "observable_gauge", "1",
    "Prompt tokens found in the prefix cache over prompt tokens looked up, since start (0..1).",
)
PREFIX_CACHE_QUERIES = MetricSpec(
    "carpool.engine.prefix_cache.queries", "observable_counter", "{token}", "Prompt tokens looked up in the prefix cache."
)
PREFIX_CACHE_HITS = MetricSpec(
    "carpool.engine.prefix_cache.hits", "observable_counter", "{token}", "Prompt tokens served from the prefix cache."
)
SPEC_DRAFTS = MetricSpec(
    "carpool.engine.spec_decode.drafts", "observable_counter", "{draft}",
    "Speculative proposals verified: one per speculating sequence and engine step.", (A_SPEC_PROPOSER,),
)
SPEC_PROPOSED = MetricSpec(
    "carpool.engine.spec_decode.proposed", "observable_counter", "{token}",
    "Tokens proposed for verification by the speculative proposer.", (A_SPEC_PROPOSER,),
)
SPEC_ACCEPTED = MetricSpec(
    "carpool.engine.spec_decode.accepted", "observable_counter", "{token}",
    "Proposed tokens the target model accepted (each saved one forward of its sequence).", (A_SPEC_PROPOSER,),
)
SPEC_MEAN_ACCEPTED_LENGTH = MetricSpec(
    "carpool.engine.spec_decode.mean_accepted_length", "observable_gauge", "{token}",
    "Tokens a speculating sequence gains per engine step, since start: 1 + accepted / drafts (0 before the "
    "first draft).", (A_SPEC_PROPOSER,),
)
LEASES_RECLAIMED = MetricSpec(
    "carpool.leases.reclaimed", "counter", "{job}", "Jobs this worker took over from a worker whose lease expired.",
    (A_LANE,),
)
DEAD_LETTERED = MetricSpec(
    "carpool.jobs.dead_lettered", "counter", "{job}", "Lane entries this worker moved to the dead-letter stream.",
    (A_LANE, A_DEAD_LETTER_REASON),
)

TENANT_JOBS = MetricSpec(
    "carpool.tenant.jobs", "counter", "{job}", "Jobs of a tenant that reached a final status, by status.",
    (A_TENANT, A_JOB_STATUS),
)
TENANT_PROMPT_TOKENS = MetricSpec(
    "carpool.tenant.prompt_tokens", "counter", "{token}", "Prompt tokens of a tenant's finished jobs.", (A_TENANT,)
)
TENANT_COMPLETION_TOKENS = MetricSpec(
    "carpool.tenant.completion_tokens", "counter", "{token}", "Generated tokens of a tenant's finished jobs.",
    (A_TENANT,),
)
TENANT_QUEUE_WAIT = MetricSpec(
    "carpool.tenant.queue_wait", "histogram", "s", "Time from submission until a worker started a tenant's job.",
    (A_TENANT, A_LANE), QUEUE_WAIT_BUCKETS_S,
)

STREAM_METRICS: tuple[MetricSpec, ...] = (QUEUE_DEPTH, QUEUE_PENDING, QUEUE_UNHELD, DEAD_LETTER_DEPTH)
SPEC_DECODE_METRICS: tuple[MetricSpec, ...] = (SPEC_DRAFTS, SPEC_PROPOSED, SPEC_ACCEPTED, SPEC_MEAN_ACCEPTED_LENGTH)
"""Exported by a worker that runs speculative decoding (``--speculative``) only."""
GATEWAY_METRICS: tuple[MetricSpec, ...] = (
    JOBS_SUBMITTED, JOBS_REJECTED, JOBS_DEDUPLICATED, JOBS_CANCELLED, OPEN_WAITERS, HTTP_SERVER_DURATION,
    WEBHOOK_DELIVERIES, WEBHOOK_DURATION, *STREAM_METRICS,
    # A job the gateway cancels while it is queued ends there, without a worker: the gateway counts it.
    JOBS_FINISHED, TENANT_JOBS,
)
WORKER_METRICS: tuple[MetricSpec, ...] = (
    JOBS_FINISHED, QUEUE_WAIT, TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, INTER_TOKEN_LATENCY, REQUEST_DURATION,
    TOKEN_USAGE,
    STEP_DURATION, STEP_TOKENS, SEQS_RUNNING, SEQS_WAITING, BATCH_OCCUPANCY, KV_CACHE_USAGE, PREEMPTIONS,
    PREFIX_CACHE_HIT_RATE, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, LEASES_RECLAIMED, DEAD_LETTERED,
    TENANT_JOBS, TENANT_PROMPT_TOKENS, TENANT_COMPLETION_TOKENS, TENANT_QUEUE_WAIT,
    *STREAM_METRICS,
)
