"""Intake of stream entries: each becomes a running job, or the outcome it gets without running.

An entry that cannot be read as a job is dead-lettered (and, when its id can be
recovered, its record marked failed); one delivered too often fails; one whose
record is already terminal, cancelled or past its deadline is settled here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from scheduler.protocol import job_record
from scheduler.protocol.job import (
    JobSpec,
    JobStatus,
    JobValidationError,
    WebhookEvent,
    WebhookSpec,
    is_stream_name,
    looks_like_json,
    parse_webhook,
)
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import EVENTS_LOG_TTL_S, Keys
from scheduler.protocol.redis_client import is_refusal
from scheduler.protocol.redis_replies import as_optional_bytes
from scheduler.protocol.state_machine import StartVerdict
from scheduler.protocol.tenants import DEFAULT_TENANT, tenant_of
from scheduler.protocol.webhooks import delivery_fields
from scheduler.protocol.wire_values import is_text
from scheduler.runtime.outage_log import describe
from scheduler.telemetry.log_format import job_context
from scheduler.telemetry.otel import span_of_traceparent
from worker.config import WorkerConfig
from worker.consumer import Entry
from worker.job_loop import JobLoop
from worker.job_store import EntryRef, JobStart, JobStore, Outcome, checkpoint_outcome, pack
from worker.metrics import WorkerMetrics
from worker.redis_errors import RetryDelay, is_redis_down, outage_log

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Turn:
    """One job id's admissions: they run one at a time (`lock`); `holders` count those holding or awaiting it."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    holders: int = 0


class EntryIntake:
    def __init__(self, config: WorkerConfig, client: aioredis.Redis, keys: Keys, store: JobStore, job_loop: JobLoop,
                 metrics: WorkerMetrics, lane_of: dict[str, str]) -> None:
        """``lane_of``: each lane's stream key to its lane name, for the metrics' labels."""
        self.config = config
        self.client = client
        self.keys = keys
        self.store = store
        self.job_loop = job_loop
        self.metrics = metrics
        self._lane_of = lane_of
        self._outages = outage_log(log)
        self.admitting: set[EntryRef] = set()
        """Entries being admitted: their leases are renewed with the running jobs'; one found lost is dropped."""
        self.is_draining = False
        """Set when the worker stops: an admission waiting for Redis gives up (the entry is redelivered)."""
        self._turns: dict[str, _Turn] = {}
        """The job ids being admitted, each with the admissions holding or awaiting its turn."""

    async def take(self, entry: Entry) -> None:
        if entry.ref in self.admitting or entry.ref in self.job_loop.commits.retrying:
            # Our own reclaim took an entry still being admitted or committed here (its lease lapsed while Redis
            # was away): that admission or commit goes on.
            self.job_loop.release(1)
            return
        self.admitting.add(entry.ref)
        try:
            # One token for every try of this admission: a START whose reply was lost, tried again, is no second start.
            await self._take_while_redis_is_down(entry, secrets.token_hex(8))
        except Exception as e:
            if is_refusal(e):
                # The worker's Redis user lacks a command (ACL), which says nothing of the entry: the worker stops
                # (see ``WorkerService``) rather than spend every entry's deliveries; the entry is redelivered.
                raise
            if is_redis_down(e) and self.is_draining:
                # Stopping with Redis away: nothing is wrong with the entry, and nothing can be written now.
                log.warning("admitting %s: stopped while Redis is unavailable (%s); it is redelivered after the lease",
                            entry.ref, e)
            elif entry.deliveries < self.config.max_deliveries or is_redis_down(e):
                # Left pending and unrenewed: redelivered after the lease, counted against max_deliveries.
                log.exception("admitting %s failed (delivery %d of at most %d)", entry.ref, entry.deliveries,
                              self.config.max_deliveries)
            else:
                log.exception("admitting %s failed on its last delivery; dead-lettering it", entry.ref,
                              extra={"entry": str(entry.ref), "dead_letter": "unadmittable"})
                await self._dead_letter_unadmittable(entry, e)
        finally:
            self.admitting.discard(entry.ref)
            self.job_loop.release(1)

    async def _take_while_redis_is_down(self, entry: Entry, start_token: str) -> None:
        """Admit the entry, trying again while Redis is unavailable: that is no fault of the job, so the entry
        stays here, its lease renewed (``admitting``), instead of going back to be redelivered and counted
        against max_deliveries. Every move of admission is safe to repeat (START by `start_token`, which makes a
        repeat answer as the first did). Given up when the worker stops or the entry is no longer ours."""
        delay = RetryDelay()
        while True:
            try:
                await self._take_one(entry, start_token)
                self._outages.recovered()
                return
            except Exception as e:
                if not is_redis_down(e) or self.is_draining or entry.ref not in self.admitting:
                    raise
                self._outages.warn("admissions", e, f"entry {entry.ref} waits to start")
                wait_s = delay.after(e)
            await asyncio.sleep(wait_s)

    async def _dead_letter_unadmittable(self, entry: Entry, error: Exception) -> None:
        """The last resort for an entry whose start keeps failing: fail its job if its id can be read,
        and put the entry on the dead stream. Only the raw fields are copied, so no content can break it."""
        reason = _safe_text(f"could not be admitted: {type(error).__name__}: {error}")
        lane = entry.lane.value
        self.metrics.dead_lettered(lane, "unadmittable")
        raw = (entry.fields or {}).get(b"job")
        loose = {} if raw is None else _loose_map(raw)
        job_id = _recover_id(loose)
        try:
            if job_id is not None and await self._is_anothers_job(job_id, entry.ref):
                # A second copy of a job another entry carries: its failure says nothing of the job, which goes on.
                await self.store.dead_letter_entry(entry.ref, reason, entry.fields or {}, job_id=job_id)
                return
            if job_id is not None:
                # Its producer hears of it where it waits, as of any failed job: the reply stream and the
                # `completed` webhook it asked for, where they are valid.
                reply_to, webhook = self._recover_destinations(loose)
                try:
                    won = await self.store.commit(Outcome(
                        job_id, JobStatus.FAILED, entry.ref, reply_to=reply_to, webhook=webhook, dead_reason=reason,
                        dead_payload=raw, traceparent=_recover_traceparent(loose),
                        error={"type": "unadmittable", "message": reason}))
                    if won:
                        created_at = _enqueued_at((entry.fields or {}).get(b"routed_from"), entry.ref.entry_id)
                        self.metrics.job_finished_unrun(lane, JobStatus.FAILED, created_at,
                                                        tenant=tenant_of(loose.get("tenant")))
                    return
                except Exception as e:
                    if is_redis_down(e):
                        raise
                    log.exception("job %s: its record cannot take the failure; dead-lettering the entry alone", job_id)
            await self.store.dead_letter_entry(entry.ref, reason, entry.fields or {}, job_id=job_id)
        except Exception as e:
            if not is_redis_down(e):
                raise
            log.warning("dead-lettering %s failed with Redis unavailable (%s); it will be redelivered", entry.ref,
                        describe(e))

    async def _is_anothers_job(self, job_id: str, ref: EntryRef) -> bool:
        """Whether `job_id` is a job that another entry carries and that has not ended: this entry is a copy."""
        try:
            raw_status, raw_owner = await self.client.hmget(self.keys.job(job_id),
                                                            [job_record.F_STATUS, job_record.F_STREAM_ENTRY])
        except ResponseError:  # its key holds no record (another type): no job of another entry
            return False
        status, owner = as_optional_bytes(raw_status), as_optional_bytes(raw_owner)
        if status is None or owner is None or owner.decode(errors="replace") == str(ref):
            return False
        return status.decode(errors="replace") in (JobStatus.QUEUED.value, JobStatus.RUNNING.value)

    async def _take_one(self, entry: Entry, start_token: str) -> None:
        ref = entry.ref
        if entry.fields is None:
            await self.store.ack(ref)  # deleted while pending: nothing left to run
            return
        # The stream entry id is its XADD time; an entry moved into its tenant's stream keeps its first id.
        created_at = _enqueued_at(entry.fields.get(b"routed_from"), ref.entry_id)
        raw = entry.fields.get(b"job")
        if raw is None:
            log.warning("%s: entry has no 'job' field; dead-lettered", ref,
                        extra={"entry": str(ref), "lane": entry.lane.value, "dead_letter": "no_job_field"})
            await self.store.dead_letter_entry(ref, "entry has no 'job' field", entry.fields)
            self.metrics.dead_lettered(entry.lane.value, "no_job_field")
            return
        try:
            spec = JobSpec.unpack(raw)
            reply_problem = self.keys.check_reply_to(spec.reply_to)
            if reply_problem is not None:
                raise JobValidationError("reply_to", reply_problem)
        except JobValidationError as e:
            # Read once, as loosely as possible: what of the message can still be used.
            loose = _loose_map(raw)
            job_id, traceparent = _recover_id(loose), _recover_traceparent(loose)
            reason = f"invalid job: {e}"
            lane = entry.lane.value
            self.metrics.dead_lettered(lane, "invalid_job")
            if job_id is None:
                log.warning("%s: %s; dead-lettered", ref, reason,
                            extra={"entry": str(ref), "lane": lane, "dead_letter": "invalid_job"})
                await self.store.dead_letter_entry(ref, reason, entry.fields)
                return
            reply_to, webhook = self._recover_destinations(loose)
            tenant = tenant_of(loose.get("tenant"))  # the record is its tenant's, if it names one
            with job_context(job_id, span_of_traceparent(traceparent)):
                # Only an id nobody used yet gets a failed record: a real job with this id is left as it is. Its
                # producer learns of it where it waits: the reply stream and webhook it asked for, when readable.
                won = await self.store.commit(Outcome(job_id, JobStatus.FAILED, ref, reply_to=reply_to, webhook=webhook,
                                                      dead_reason=reason, dead_payload=raw, traceparent=traceparent,
                                                      is_new_record_only=True, lane=lane, created_at=created_at,
                                                      tenant=None if tenant == DEFAULT_TENANT else tenant,
                                                      error={"type": "invalid_job", "field": e.field, "message": str(e)}))
                log.warning("job %s: %s; dead-lettered%s", job_id, reason,
                            " and failed" if won else " (the id names an existing job, which is left alone)",
                            extra={"entry": str(ref), "lane": lane, "dead_letter": "invalid_job"})
                if won:
                    self.metrics.job_finished_unrun(lane, JobStatus.FAILED, created_at, tenant=tenant)
            return
        if spec.lane != entry.lane:
            # The stream it waited in is its lane: a direct producer may leave `lane` out (standard by default).
            spec = dataclasses.replace(spec, lane=entry.lane)
        # Every line about this job names it and its trace (the message's context until the job's own span opens).
        # Entries of one id read together are admitted in the order they were read (their streams' order): the
        # first one starts the job, the later ones find it started.
        with job_context(spec.id, span_of_traceparent(spec.traceparent)):
            async with self._in_turn(spec.id):
                await self._take_spec(spec, entry, raw, created_at, start_token)

    @asynccontextmanager
    async def _in_turn(self, job_id: str) -> AsyncIterator[None]:
        """Hold `job_id`'s turn: admissions of one id run one at a time, first come first served."""
        turn = self._turns.get(job_id)
        if turn is None:
            turn = self._turns[job_id] = _Turn()
        turn.holders += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.holders -= 1
            if not turn.holders:
                del self._turns[job_id]

    def _recover_destinations(self, data: dict[Any, Any]) -> tuple[str | None, WebhookSpec | None]:
        """The reply stream and webhook an invalid message (`_loose_map`) asked for, each where it is valid on its
        own."""
        reply_to = data.get("reply_to")
        if not is_stream_name(reply_to) or self.keys.check_reply_to(reply_to) is not None:
            reply_to = None
        try:
            webhook = parse_webhook(data.get("webhook"))
        except JobValidationError:
            webhook = None
        return reply_to, webhook

    async def _take_spec(self, spec: JobSpec, entry: Entry, raw: bytes, created_at: float, start_token: str) -> None:
        ref = entry.ref
        lane = spec.lane.value
        running = self.job_loop.jobs.get(spec.id)
        if running is not None and running.entry == ref:
            # Our own reclaim took our entry after a late renewal: the job still runs here, and the claim renewed it.
            log.info("job %s: reclaimed our own running entry %s; it keeps running", spec.id, ref)
            return
        if entry.deliveries > 1:
            log.info("job %s: reclaimed from %s (delivery %d): its previous worker stopped renewing or handed it back",
                     spec.id, ref, entry.deliveries, extra={"entry": str(ref), "lane": lane, "delivery": entry.deliveries})
        if entry.deliveries > self.config.max_deliveries:
            # Only deliveries whose worker died or gave up count: a clean hand-back is no sign of poison.
            raw_checkpoint, raw_handbacks, raw_owner = await self.client.hmget(
                self.keys.job(spec.id), [job_record.F_CHECKPOINT, job_record.F_HANDBACKS, job_record.F_STREAM_ENTRY])
            owner = as_optional_bytes(raw_owner)
            if owner is not None and owner.decode(errors="replace") != str(ref):
                # Another entry carries the job (a producer's second XADD of its id): this copy's deliveries say
                # nothing of the job, which goes on from its own entry; only this copy is dead-lettered.
                reason = (f"a second entry of job {spec.id!r}, delivered {entry.deliveries} times; the job is left "
                          f"to its entry {owner.decode(errors='replace')}")
                log.warning("%s: %s", ref, reason, extra={"entry": str(ref), "lane": lane,
                                                           "dead_letter": "duplicate_entry"})
                self.metrics.dead_lettered(lane, "duplicate_entry")
                await self.store.dead_letter_entry(ref, reason, entry.fields or {})
                return
            handbacks = int(raw_handbacks or 0)
            if entry.deliveries - handbacks > self.config.max_deliveries:
                await self._fail_too_many(spec, entry, raw, created_at, handbacks, as_optional_bytes(raw_checkpoint))
                return
        start = await self.store.start(spec, ref, created_at, time.time(), start_token)
        if start.verdict is not StartVerdict.RUN:
            log.info("job %s: not run (%s, was %s)", spec.id, start.verdict, start.previous_status or "new",
                     extra={"entry": str(ref), "lane": lane, "verdict": start.verdict})
        if start.verdict in (StartVerdict.TERMINAL, StartVerdict.DUPLICATE):
            await self.store.ack(ref)
            if start.verdict is StartVerdict.TERMINAL:
                # Decided elsewhere: the gateway, which cancelled it while it waited here (read before the cancel
                # deleted the entry), counted it and settled its tenant's usage; settling is once per job, so this
                # only makes sure of it.
                await self.store.settle(spec.id, spec.tenant, start.previous_status, None)
        elif start.verdict is StartVerdict.CANCEL:
            output, usage, message = None, None, "cancelled before it started"
            if start.previous_status == JobStatus.RUNNING.value:
                # Cancelled while its worker was gone: what it had checkpointed stays its output, as a cancel of a
                # job running here keeps what it produced.
                raw_checkpoint = await self.client.hget(self.keys.job(spec.id), job_record.F_CHECKPOINT)
                output, usage = checkpoint_outcome(as_optional_bytes(raw_checkpoint), "abort")
                message = "cancelled while running (its worker had stopped)"
            await self.store.commit(Outcome(spec.id, JobStatus.CANCELLED, ref, reply_to=spec.reply_to, webhook=spec.webhook,
                                            traceparent=spec.traceparent, output=output, usage=usage,
                                            error={"type": "cancelled", "message": message}))
            self.metrics.job_finished_unrun(spec.lane.value, JobStatus.CANCELLED, created_at, tenant=spec.tenant)
        elif start.verdict is StartVerdict.EXPIRE:
            await self.store.commit(Outcome(spec.id, JobStatus.EXPIRED, ref, reply_to=spec.reply_to, webhook=spec.webhook,
                                            traceparent=spec.traceparent,
                                            error={"type": "expired", "message": "deadline passed before the job started"}))
            self.metrics.job_finished_unrun(spec.lane.value, JobStatus.EXPIRED, created_at, tenant=spec.tenant)
        else:
            assert start.verdict is StartVerdict.RUN, start.verdict
            await self._announce_start(spec, start)
            self.job_loop.start(spec, ref, start.checkpoint, created_at, start.record, start.checkpoint_logprobs,
                                attempt=start.attempts)
            log.info("job %s: admitted from %s (attempt %d, resuming after %d tokens)", spec.id, ref,
                     start.attempts, len(start.checkpoint),
                     extra={"entry": str(ref), "lane": lane, "attempt": start.attempts,
                            "resumed_from": len(start.checkpoint)})

    async def _fail_too_many(self, spec: JobSpec, entry: Entry, raw: bytes, created_at: float, handbacks: int,
                             raw_checkpoint: bytes | None) -> None:
        """Dead-letter a job delivered too often and fail it, keeping the output it had checkpointed."""
        counted = entry.deliveries - handbacks
        reason = (f"delivered {entry.deliveries} times, {counted} of them not handed back cleanly "
                  f"(max_deliveries {self.config.max_deliveries}): this delivery does not run it again, so its "
                  "attempts stay at the runs started before")
        log.warning("job %s: %s; dead-lettered and failed", spec.id, reason,
                    extra={"entry": str(entry.ref), "lane": spec.lane.value, "dead_letter": "too_many_deliveries"})
        self.metrics.dead_lettered(spec.lane.value, "too_many_deliveries")
        output, usage = checkpoint_outcome(raw_checkpoint, None)
        if await self.store.commit(Outcome(spec.id, JobStatus.FAILED, entry.ref, reply_to=spec.reply_to,
                                           webhook=spec.webhook, traceparent=spec.traceparent, dead_reason=reason,
                                           dead_payload=raw, output=output, usage=usage,
                                           lane=spec.lane.value, created_at=created_at,
                                           error={"type": "too_many_deliveries", "message": reason})):
            self.metrics.job_finished_unrun(spec.lane.value, JobStatus.FAILED, created_at, tenant=spec.tenant)

    async def _announce_start(self, spec: JobSpec, start: JobStart) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            # Shown while it runs: how many output tokens this attempt took over from a checkpoint.
            pipe.hset(self.keys.job(spec.id), job_record.F_RESUMED_FROM, len(start.checkpoint))
            started = pack({
                "type": job_record.EventType.STARTED, "id": spec.id, "worker": self.config.worker_name,
                "attempts": start.attempts, "attempt": start.attempts, "resumed_from": len(start.checkpoint)})
            pipe.publish(self.keys.events(spec.id), started)
            pipe.xadd(self.keys.events_log(spec.id), {"e": started})
            pipe.expire(self.keys.events_log(spec.id), EVENTS_LOG_TTL_S)
            if start.is_first_start and spec.webhook is not None and spec.webhook.wants(WebhookEvent.STARTED):
                view = job_view(start.record)
                pipe.xadd(self.keys.webhooks, delivery_fields(spec.id, WebhookEvent.STARTED, spec.webhook.url, view,
                                                              traceparent=spec.traceparent))
            await pipe.execute()


def _loose_map(raw: bytes) -> dict[Any, Any]:
    """An invalid ``job`` field read as loosely as possible: JSON (redis-cli producers) or msgpack; empty when
    it holds no map at all."""
    try:
        data = json.loads(raw) if looks_like_json(raw) else msgpack.unpackb(
            raw, raw=False, strict_map_key=False, unicode_errors="surrogateescape")  # as `JobSpec.unpack` reads it
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def _recover_traceparent(data: dict[Any, Any]) -> str | None:
    """The ``traceparent`` of an invalid message (`_loose_map`), when it has one, so its lines join the
    producer's trace."""
    traceparent = data.get("traceparent")
    return traceparent if isinstance(traceparent, str) and is_text(traceparent) else None


def _recover_id(data: dict[Any, Any]) -> str | None:
    """The job id of an invalid message (`_loose_map`), when it has one, so its record can be marked failed."""
    job_id = data.get("id")
    if isinstance(job_id, str) and job_id and len(job_id) <= 128 and job_id.isprintable() and " " not in job_id:
        return job_id
    return None


def _enqueued_at(routed_from: bytes | None, entry_id: str) -> float:
    """Unix seconds of an entry's first XADD: its id's time, or that of the id it was routed from; never later
    than now (a producer may XADD with an explicit id from the future, and every ``*`` id after it in the lane
    follows it there), so no job waits or runs a negative time."""
    now = time.time()
    for raw in (routed_from, entry_id.encode()):
        try:
            return min(now, int((raw or b"").split(b"-", 1)[0]) / 1000)
        except ValueError:
            continue
    return now


def _safe_text(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (a lone surrogate from the payload) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
