"""The job record's field names and its public view.

The job record is a Redis hash whose field names are the ``F_*`` constants
below; ``job_view`` turns it into the public shape returned by
``GET /v1/jobs/{id}``, XADDed to reply streams and sent as webhook data.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgpack

from scheduler.protocol.tenants import DEFAULT_TENANT, tenant_of

# Job record hash fields. Numbers are stored as decimal strings, structures as msgpack.
F_ID = "id"
F_STATUS = "status"
F_LANE = "lane"
F_PRIORITY = "priority"
F_SPEC = "spec"  # msgpack of the wire map
F_CREATED_AT = "created_at"  # unix s
F_STARTED_AT = "started_at"  # unix s
F_FIRST_TOKEN_AT = "first_token_at"  # unix s
F_FINISHED_AT = "finished_at"  # unix s
F_WORKER = "worker"
F_ATTEMPTS = "attempts"
F_CHECKPOINT = "checkpoint"  # msgpack list[int] of the output tokens so far, or {token_ids, logprobs?, text?, prompt_tokens?}
F_HANDBACKS = "handbacks"  # int: deliveries that ended in a clean hand-back (not counted against max_deliveries)
F_RESUMED_FROM = "resumed_from"  # int: output tokens recovered from a checkpoint on the last resume
F_OUTPUT = "output"  # msgpack {text, token_ids, finish_reason}
F_USAGE = "usage"  # msgpack {prompt_tokens, completion_tokens, cached_tokens}
F_ERROR = "error"  # msgpack {type, message}
F_STREAM_ENTRY = "stream_entry"  # "<lane stream key> <entry id>"
F_IDEMPOTENCY_KEY = "idempotency_key"  # the Redis key of the Idempotency-Key that named it: expires with the record
F_IDEMPOTENCY_KEYS = "idempotency_keys"  # newline-joined Redis keys of further Idempotency-Keys that named it since
F_BATCH_COUNT = "batch_count"  # a Batch API line's: the Redis key of its tenant's count of lines, until it ends
F_RESERVATION = "reservation"  # "<rate window id> <tokens>": tokens/min reserved at submission, settled at the end
F_USAGE_COUNTED = "usage_counted"  # "1" once the job's tokens are in its tenant's usage and its reservation settled
F_START_TOKEN = "start_token"  # the admission that last started it: a START it repeats (a lost reply) is not a new start
F_START_FOUND = "start_found"  # the status that admission found, answered again to its repeat
F_WEBHOOK_COUNT = "wh_count"
WEBHOOK_ATTEMPT_PREFIX = "wh:"  # wh:<n> -> msgpack attempt record
F_WEBHOOK_GONE = "wh_gone"  # set when a receiver answered 410: the job's later events are not sent


class EventType(StrEnum):
    """The ``type`` of an event on a job's channel (``keys.events(id)``) and its events log."""

    STARTED = "started"
    """An attempt began: ``worker``, ``attempts``, ``resumed_from``."""
    TOKEN = "token"
    """Output the step added: ``index``, ``token_ids``, ``text``."""
    FINAL = "final"
    """The job ended: its terminal record's view (``final_event``)."""


def json_default(value: object) -> object:
    """``json.dumps`` default for views: a record written before message values were checked may hold bytes."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON data")


def _text(record: dict[bytes, bytes], name: str) -> str | None:
    raw = record.get(name.encode())
    return None if raw is None else raw.decode()


def _float(record: dict[bytes, bytes], name: str) -> float | None:
    raw = _text(record, name)
    return float(raw) if raw else None


def _int(record: dict[bytes, bytes], name: str) -> int | None:
    raw = _text(record, name)
    return int(raw) if raw else None


def _unpacked(record: dict[bytes, bytes], name: str) -> Any:
    raw = record.get(name.encode())
    return None if raw is None else msgpack.unpackb(raw, raw=False, strict_map_key=False)


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 6)


def tenant_of_record(record: dict[bytes, bytes]) -> str:
    """The tenant a job record belongs to: its message's ``tenant`` (the default tenant when it names none)."""
    try:
        spec = _unpacked(record, F_SPEC)
    except Exception:  # a record whose spec cannot be read belongs to nobody in particular
        return DEFAULT_TENANT
    return tenant_of(spec.get("tenant") if isinstance(spec, dict) else None)


def job_view(record: dict[bytes, bytes]) -> dict[str, Any]:
    """Public shape of a job record (HTTP GET, reply streams, webhook data)."""
    created = _float(record, F_CREATED_AT)
    started = _float(record, F_STARTED_AT)
    first_token = _float(record, F_FIRST_TOKEN_AT)
    finished = _float(record, F_FINISHED_AT)
    spec = _unpacked(record, F_SPEC) or {}
    attempts = []
    for key, raw in record.items():
        name = key.decode()
        if name.startswith(WEBHOOK_ATTEMPT_PREFIX):
            attempts.append((int(name[len(WEBHOOK_ATTEMPT_PREFIX):]), msgpack.unpackb(raw, raw=False)))
    return {
        "id": _text(record, F_ID),
        "status": _text(record, F_STATUS),
        "lane": _text(record, F_LANE),
        "tenant": tenant_of(spec.get("tenant")),
        "priority": _int(record, F_PRIORITY) or 0,
        "worker": _text(record, F_WORKER),
        "attempts": _int(record, F_ATTEMPTS) or 0,
        "resumed_from": _int(record, F_RESUMED_FROM),
        "created_at": created,
        "started_at": started,
        "finished_at": finished,
        "output": _unpacked(record, F_OUTPUT),
        "usage": _unpacked(record, F_USAGE),
        "error": _unpacked(record, F_ERROR),
        "timings": {
            "queued_s": _elapsed(created, started),
            "ttft_s": _elapsed(created, first_token),
            "e2e_s": _elapsed(created, finished),
        },
        "metadata": spec.get("metadata"),
        "webhooks": [a for _, a in sorted(attempts, key=lambda pair: pair[0])],
    }


def final_event(job_id: str, view: dict[str, Any], attempt: int) -> dict[str, Any]:
    """A job's ``final`` event: its terminal record's view, as its events channel and SSE stream carry it."""
    return {"type": EventType.FINAL, "id": job_id, "attempt": attempt, "job": view}
