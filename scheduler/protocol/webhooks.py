"""Webhook policy without I/O: event types, the delivery entry, the payload and the retry schedule.

The worker builds delivery entries with `delivery_fields` and XADDs them to
``keys.webhooks`` in its result-commit pipeline; the dispatcher in
``gateway.webhooks`` sends them, signs them and follows `RetryPolicy`.
The body of a delivery is fixed here, at enqueue, so every retry sends exactly
the same signed bytes.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from enum import Enum
from typing import Any

import msgpack
from redis.typing import EncodableT, FieldT

from scheduler.protocol.job import JobStatus, WebhookEvent
from scheduler.protocol.job_record import F_FIRST_TOKEN_AT, F_OUTPUT, F_RESUMED_FROM, F_STATUS, job_view, json_default

DEFAULT_OUTPUT_INTERVAL_S = 0.5
"""Least time between two ``output`` callbacks of one job (at most 2 a second)."""

DEFAULT_RETRY_SCHEDULE_S: tuple[float, ...] = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 7200.0)
"""Delay before retry n (n = 1, 2, ...) after a failed attempt; the last value repeats."""

DEFAULT_MAX_ATTEMPTS = len(DEFAULT_RETRY_SCHEDULE_S) + 1
"""First attempt plus one retry per schedule step; then the delivery is dead-lettered."""

DEFAULT_JITTER_FRACTION = 0.2
"""Each scheduled delay is scaled by a uniform factor in [1 - j, 1 + j]."""

DEFAULT_MAX_RETRY_AFTER_S = 3600.0
"""Cap on a receiver's ``Retry-After`` so one endpoint cannot park a delivery forever."""

DEFAULT_TIMEOUT_S = 10.0
"""Whole-request timeout of one attempt (connect, send, response headers and body)."""

DELIVERY_ID_PREFIX = "msg_"


class AttemptOutcome(str, Enum):
    """What one attempt led to; also the delivery's final state once it is not ``retrying``."""

    DELIVERED = "delivered"
    RETRYING = "retrying"
    GONE = "gone"
    """The receiver answered 410: no more attempts, and none for the job's later events."""
    DEAD = "dead"
    """The schedule ran out; the delivery is on the dead-letter stream."""


# Field names of a delivery entry on ``keys.webhooks`` (and of the delivery hash).
F_ID = "id"
F_JOB_ID = "job_id"
F_EVENT = "event"
F_URL = "url"
F_PAYLOAD = "payload"
F_CREATED_AT = "created_at"
F_TRACEPARENT = "traceparent"
"""W3C trace context of the job the delivery reports on: each attempt is a span in that job's trace."""


def should_send(spec_events: Iterable[WebhookEvent | str] | None, event: WebhookEvent | str) -> bool:
    """Whether a job whose webhook asked for `spec_events` (None = all) gets `event`."""
    if spec_events is None:
        return True
    wanted = {WebhookEvent(e) for e in spec_events}
    return WebhookEvent(event) in wanted


def new_delivery_id() -> str:
    """``msg_`` + 128 random bits: the ``webhook-id`` every attempt of one delivery carries."""
    return DELIVERY_ID_PREFIX + secrets.token_hex(16)


def iso_timestamp(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_payload(event: WebhookEvent | str, data: dict[str, Any], *, now: float) -> bytes:
    """The JSON body ``{type, timestamp, data}``; `data` is the job record as the HTTP API shows it."""
    body = {"type": WebhookEvent(event).value, "timestamp": iso_timestamp(now), "data": data}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=json_default).encode()


def running_view(
    record: dict[bytes, bytes], text: str, token_ids: list[int], *, first_token_at: float | None,
    resumed_from: int | None,
) -> dict[str, Any]:
    """Data of an ``output`` event: the job view of `record` (as read when the job started) with the output so far.

    The worker holds the record and the tokens in memory, so a callback per step costs no read.
    """
    running = dict(record)
    running[F_STATUS.encode()] = JobStatus.RUNNING.value.encode()
    running[F_OUTPUT.encode()] = msgpack.packb({"text": text, "token_ids": token_ids, "finish_reason": None})
    if first_token_at is not None:
        running.setdefault(F_FIRST_TOKEN_AT.encode(), repr(first_token_at).encode())
    if resumed_from is not None:
        running[F_RESUMED_FROM.encode()] = str(resumed_from).encode()
    return job_view(running)


def delivery_fields(
    job_id: str,
    event: WebhookEvent | str,
    url: str,
    data: dict[str, Any],
    *,
    now: float | None = None,
    delivery_id: str | None = None,
    traceparent: str | None = None,
) -> dict[FieldT, EncodableT]:
    """The fields of one entry to XADD on ``keys.webhooks`` (`now` defaults to the current time).

    Names are str and values bytes; the dict is typed as XADD takes it, since a dict's types are invariant.

    `traceparent` is the job's trace context; the dispatcher's attempt spans become its children.
    """
    if now is None:
        now = time.time()
    fields: dict[FieldT, EncodableT] = {
        F_ID: (delivery_id or new_delivery_id()).encode(),
        F_JOB_ID: job_id.encode(),
        F_EVENT: WebhookEvent(event).value.encode(),
        F_URL: url.encode(),
        F_PAYLOAD: build_payload(event, data, now=now),
        F_CREATED_AT: repr(now).encode(),
    }
    if traceparent:
        fields[F_TRACEPARENT] = traceparent.encode()
    return fields


class BatchEvent(str, Enum):
    """The one callback a Batch API batch sends when it ends, named as OpenAI names its batch events."""

    COMPLETED = "batch.completed"
    FAILED = "batch.failed"
    EXPIRED = "batch.expired"
    CANCELLED = "batch.cancelled"


EVENT_ID_PREFIX = "evt_"


def batch_delivery_fields(batch_id: str, event: BatchEvent, url: str, batch: dict[str, Any], *,
                          now: float) -> dict[FieldT, EncodableT]:
    """The entry to XADD on ``keys.webhooks`` when a batch ends.

    The body is OpenAI's event object (``{id, object, type, created_at, data}``, ``data.id`` the batch id), so
    OpenAI's own webhook helpers (``client.webhooks.unwrap``) read it; ``data`` also holds the whole batch
    object. The delivery is keyed to the batch id, which orders and records it as a job id would be.
    """
    body = {"id": EVENT_ID_PREFIX + secrets.token_hex(16), "object": "event", "type": event.value,
            "created_at": int(now), "data": {**batch, "id": batch_id}}
    return {
        F_ID: new_delivery_id().encode(),
        F_JOB_ID: batch_id.encode(),
        F_EVENT: event.value.encode(),
        F_URL: url.encode(),
        F_PAYLOAD: json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=json_default).encode(),
        F_CREATED_AT: repr(now).encode(),
    }


@dataclass
class OutputThrottle:
    """Per-job gate for ``output`` callbacks: at most one every `interval_s`."""

    interval_s: float = DEFAULT_OUTPUT_INTERVAL_S
    last_sent_at: float | None = None

    def should_emit(self, now: float) -> bool:
        if self.last_sent_at is not None and now - self.last_sent_at < self.interval_s:
            return False
        self.last_sent_at = now
        return True


@dataclass(frozen=True)
class RetryPolicy:
    schedule_s: tuple[float, ...] = DEFAULT_RETRY_SCHEDULE_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    jitter_fraction: float = DEFAULT_JITTER_FRACTION
    max_retry_after_s: float = DEFAULT_MAX_RETRY_AFTER_S

    def __post_init__(self) -> None:
        if not self.schedule_s or any(d < 0 for d in self.schedule_s):
            raise ValueError("webhook retry schedule: needs at least one delay, none negative")
        if self.max_attempts < 1:
            raise ValueError("webhook max attempts: must be at least 1")
        if not 0 <= self.jitter_fraction < 1:
            raise ValueError("webhook jitter: must be in [0, 1)")
        if self.max_retry_after_s < 0:
            raise ValueError("webhook max Retry-After: must not be negative")

    def backoff_s(self, attempt: int, rand: float) -> float:
        """Delay after failed attempt `attempt` (1-based); `rand` is uniform in [0, 1)."""
        assert attempt >= 1 and 0 <= rand < 1
        base = self.schedule_s[min(attempt - 1, len(self.schedule_s) - 1)]
        return base * (1 + self.jitter_fraction * (2 * rand - 1))


@dataclass(frozen=True)
class Decision:
    outcome: AttemptOutcome
    delay_s: float | None
    """Seconds until the next attempt when retrying, else None."""
    reason: str | None
    """Why the delivery failed (for the dead-letter entry), None when delivered."""


def decide(
    policy: RetryPolicy,
    attempt: int,
    status_code: int | None,
    error: str | None,
    retry_after_s: float | None,
    rand: float,
    *,
    is_refused: bool = False,
) -> Decision:
    """Sort one attempt's result into delivered / gone / retry / dead.

    `is_refused`: the URL itself was refused before any request (its scheme or host, an address the rules
    refuse, a URL the HTTP client cannot send to), which no retry can change, so the delivery is dead at once.
    A ``Retry-After`` on a 429 or 503 can lengthen the schedule's delay for this attempt, up to
    ``max_retry_after_s``, but never shorten it: a receiver answering ``Retry-After: 0`` still gets the schedule.
    """
    if status_code is not None and 200 <= status_code < 300:
        return Decision(AttemptOutcome.DELIVERED, None, None)
    if status_code == 410:
        return Decision(AttemptOutcome.GONE, None, "receiver answered 410 Gone")
    reason = error if status_code is None else f"receiver answered {status_code}"
    if is_refused:
        return Decision(AttemptOutcome.DEAD, None, f"{reason} (attempt {attempt}; not retried, no retry can change it)")
    if attempt >= policy.max_attempts:
        return Decision(AttemptOutcome.DEAD, None, f"{reason} (attempt {attempt} of {policy.max_attempts})")
    delay = policy.backoff_s(attempt, rand)
    if status_code in (429, 503) and retry_after_s is not None:
        delay = max(delay, min(retry_after_s, policy.max_retry_after_s))
    return Decision(AttemptOutcome.RETRYING, delay, reason)


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(when.timestamp() - now, 0.0)


@dataclass
class AttemptRecord:
    """One attempt as shown on the job record (field ``wh:<n>``) and in ``webhooks`` of the job view."""

    delivery_id: str
    event: str
    attempt: int
    at: float
    status_code: int | None
    error: str | None
    next_at: float | None
    outcome: str

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    def pack(self) -> bytes:
        packed: bytes = msgpack.packb(self.to_wire(), use_bin_type=True)
        return packed
