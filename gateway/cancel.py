"""Cancelling a job from the gateway.

A queued job is cancelled on the spot by one Lua script that, only when it
moves the job from ``queued`` to ``cancelled``, also publishes the final
event, adds the reply stream entry, enqueues the ``completed`` webhook,
deletes the job's lane entry (so it stops counting in the lane's depth and the
tenant's queued jobs, and no worker ever runs it) and settles the tenant's
usage — so a gateway that dies mid-way leaves all of it or none of it, never
a cancelled job that nobody hears about. The gateway, having decided the job's
end, counts it among the finished jobs. A running job belongs to its worker:
the gateway raises the cancel flag and tells workers on the control channel;
the worker stops it at its next step and writes `cancelled` itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import redis.asyncio as aioredis

from scheduler.protocol import state_machine
from scheduler.protocol.job import TERMINAL_STATUSES, JobSpec, JobStatus, JobValidationError, WebhookEvent
from scheduler.protocol.job_record import (
    F_ERROR,
    F_FINISHED_AT,
    F_SPEC,
    F_STATUS,
    F_STREAM_ENTRY,
    final_event,
    job_view,
    tenant_of_record,
)
from scheduler.protocol.keys import CONSUMER_GROUP, DEFAULT_REPLY_MAXLEN, Keys
from scheduler.protocol.redis_replies import as_optional_bytes, read_hash
from scheduler.protocol.tenants import DEFAULT_TENANT
from scheduler.protocol.webhooks import delivery_fields, should_send


class CancelMetrics(Protocol):
    def job_cancelled(self, state: str) -> None: ...

    def job_cancelled_queued(self, lane: str, tenant: str) -> None: ...


class JobNotFound(Exception):
    pass


_ENDED_OTHERWISE = {status.value for status in TERMINAL_STATUSES} - {JobStatus.CANCELLED.value}
"""The final statuses of a job its cancel came too late for."""


class AlreadyFinished(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(f"job already {status}")
        self.status = status


@dataclass(frozen=True)
class CancelOutcome:
    view: dict[str, Any]
    is_cancelled_now: bool
    """True when the job was queued and is now cancelled; False when its worker was asked to stop."""


class Canceller:
    def __init__(self, redis: aioredis.Redis, keys: Keys, flag_ttl_s: int,
                 reply_maxlen: int = DEFAULT_REPLY_MAXLEN, metrics: CancelMetrics | None = None) -> None:
        self._redis = redis
        self._keys = keys
        self._flag_ttl_s = flag_ttl_s
        self._reply_maxlen = reply_maxlen
        self._metrics = metrics
        self._cancel = redis.register_script(state_machine.CANCEL)

    async def cancel(self, job_id: str) -> CancelOutcome:
        outcome, view = await self.transition(job_id)
        if outcome == "missing":
            raise JobNotFound(job_id)
        if outcome not in ("+cancelled", "+cancelling"):
            raise AlreadyFinished(outcome)
        if outcome == "+cancelling":
            running = job_view(await read_hash(self._redis, self._keys.job(job_id)))
            status = str(running.get("status"))
            if status in _ENDED_OTHERWISE:
                # Its worker ended it between the flag and this read, before any step could see the flag.
                raise AlreadyFinished(status)
            if self._metrics is not None:
                self._metrics.job_cancelled("running")
            return CancelOutcome(running, is_cancelled_now=False)
        if self._metrics is not None:
            self._metrics.job_cancelled("queued")
            self._metrics.job_cancelled_queued(str(view.get("lane") or ""), str(view.get("tenant") or DEFAULT_TENANT))
        return CancelOutcome(view, is_cancelled_now=True)

    async def transition(self, job_id: str) -> tuple[str, dict[str, Any]]:
        """Run the cancel script once: its outcome, and the record's view as a queued job's cancel wrote it.

        Everything the cancel of a queued job sends is built from the record read here, before the
        script: a queued record changes only through the script's own status write or a worker's
        admission, and the script delivers only when it finds the job still queued.
        """
        record = await read_hash(self._redis, self._keys.job(job_id))
        if not record:
            return "missing", {}
        now = repr(time.time())
        error = msgpack.packb({"type": "cancelled", "message": "cancelled before it started"})
        control = msgpack.packb({"type": "cancel", "id": job_id})
        cancelled = dict(record)
        cancelled.update({F_STATUS.encode(): JobStatus.CANCELLED.value.encode(), F_FINISHED_AT.encode(): now.encode(),
                          F_ERROR.encode(): error})
        view = job_view(cancelled)
        try:
            spec: JobSpec | None = JobSpec.unpack(record[F_SPEC.encode()])
        except (KeyError, JobValidationError):
            spec = None  # a record without a readable spec (written before values were checked) still cancels
        webhook: list[Any] = []
        if spec is not None and spec.webhook is not None and should_send(spec.webhook.events, WebhookEvent.COMPLETED):
            for k, v in delivery_fields(spec.id, WebhookEvent.COMPLETED, spec.webhook.url, view,
                                        traceparent=spec.traceparent).items():
                webhook += [k, v]
        final = msgpack.packb(final_event(job_id, view, view["attempts"]))
        # A reply key inside carpool's prefix (admitted before such names were refused) gets no reply.
        reply_to = None if spec is None or self._keys.check_reply_to(spec.reply_to) else spec.reply_to
        # "<stream> <entry id>", as the enqueue wrote it; the script deletes the entry only if the record still names it.
        stream, _, entry_id = (as_optional_bytes(record.get(F_STREAM_ENTRY.encode())) or b"").decode(
            errors="replace").rpartition(" ")
        tenant = tenant_of_record(record)
        outcome = (
            await self._cancel(
                keys=[self._keys.job(job_id), self._keys.cancel(job_id), reply_to or self._keys.dead,
                      self._keys.webhooks, stream or self._keys.dead, self._keys.tenant_window(tenant),
                      self._keys.tenant_usage(tenant)],
                args=[now, error, self._flag_ttl_s, self._keys.control, control, self._keys.events(job_id), final,
                      msgpack.packb(view) if reply_to else "", self._reply_maxlen, entry_id if stream else "",
                      CONSUMER_GROUP, *webhook],
            )
        ).decode()
        return outcome, view
