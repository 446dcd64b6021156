"""The worker process: Redis wiring, intake, leases, cancellation, heartbeat, health server, shutdown.

Background tasks are owned here (one reference each, reaped, an exception
stops the worker). Shutdown runs in two phases: stop intake and let in-flight
jobs finish within the grace period, then checkpoint the rest and hand their
entries back so another worker resumes them at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

import msgpack
import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler.job import JobSpec, JobStatus, JobValidationError, WebhookEvent
from scheduler.job_record import job_view
from scheduler.keys import Keys
from scheduler.lanes import Lane
from scheduler.log_format import job_context
from scheduler.telemetry import Telemetry, span_of_traceparent
from scheduler.tasks import raise_if_cancelled
from scheduler.webhooks import delivery_fields
from worker.config import WorkerConfig
from worker.consumer import Entry, LaneConsumer
from worker.engine_tick import as_runner
from worker.job_loop import JobLoop
from worker.metrics import METRICS_KEY, WorkerMetrics, metrics_handler
from worker.results import Admission, Outcome, ResultStore, pack

log = logging.getLogger(__name__)

# A dropped or unreachable Redis: the background loops wait and retry instead of stopping the worker.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
REDIS_RETRY_S = 0.5
RESERVE_POLL_S = 0.02
"""How often a worker with every slot busy looks for interactive entries for its reserve."""


class WorkerService:
    def __init__(self, config: WorkerConfig, engine: Any, client: aioredis.Redis,
                 telemetry: Telemetry | None = None) -> None:
        """``engine``: an ``EngineProcess`` (or other ``EngineRunner``), or an in-process ``Engine`` run on a thread."""
        self.config = config
        self.engine = engine
        self.runner = as_runner(engine)
        self.client = client
        self.keys = Keys(config.key_prefix)
        self.store = ResultStore(client, self.keys, worker=config.worker_name, result_ttl_s=config.result_ttl_s,
                                 reply_maxlen=config.reply_maxlen, dead_maxlen=config.dead_maxlen)
        self.consumer = LaneConsumer(client, self.keys, config.worker_name, {lane: config.weight(lane) for lane in Lane},
                                     lease_ms=config.lease_ms, read_block_ms=config.read_block_ms,
                                     max_deliveries=config.max_deliveries)
        # ``telemetry`` (built by the CLI from the OTEL_* variables) stays the caller's to shut down.
        self.metrics = WorkerMetrics(telemetry, max_num_seqs=self.runner.max_num_seqs)
        self._lane_of = {self.keys.lane(lane): lane.value for lane in Lane}
        self.loop = JobLoop(self.runner, self.store, client, self.keys, config, self.metrics)
        self.is_ready = False
        self.is_draining = False
        self.stopped = asyncio.Event()
        """Set when the worker should stop: a signal, or a background task that failed."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pubsub: Any = None
        self._http: web.AppRunner | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.consumer.ensure_groups()
        self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        # Subscribe before reading any entry: a cancel published after admission is then never missed.
        await self._pubsub.subscribe(self.keys.control)
        self.metrics.watch_streams(self.client, self.keys)
        self._spawn("engine", self.loop.run())
        self._spawn("control", self._control())
        self._spawn("leases", self._leases())
        self._spawn("heartbeat", self._heartbeat())
        self._spawn("intake", self._intake())
        if self.config.metrics_port:
            await self.start_http(self.config.metrics_host, self.config.metrics_port)
        self.is_ready = True
        log.info("worker %s ready (capacity %d)", self.config.worker_name, self.config.capacity)

    async def shutdown(self) -> None:
        """Stop intake, drain to the grace deadline, hand back the rest, then cancel."""
        self.is_draining = True
        self.is_ready = False
        intake = self._tasks.pop("intake", None)
        if intake is not None:
            await asyncio.gather(intake, return_exceptions=True)
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.loop.jobs and time.monotonic() < deadline and not self._failed():
            self.loop.slot_freed.clear()
            try:
                await asyncio.wait_for(self.loop.slot_freed.wait(), timeout=min(0.2, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                pass
        if self.loop.jobs:
            refs = await self.loop.checkpoint_all()
            await self.consumer.hand_back(refs)
            log.info("handed back %d unfinished jobs with their checkpoints", len(refs))
        await self.loop.wait_commits()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._pubsub is not None:
            await self._pubsub.aclose()
        await self.client.hdel(self.keys.workers, self.config.worker_name)
        if self._http is not None:
            await self._http.cleanup()
        await self.loop.aclose()
        if self.metrics.streams is not None:
            await self.metrics.streams.aclose()
        self.metrics.close()

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"worker {name}")
        self._tasks[name] = task
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s failed; stopping the worker", task.get_name(), exc_info=exc)
            self.stopped.set()

    @property
    def has_failed(self) -> bool:
        """A background task died: the worker stops, and its process exits non-zero."""
        return self._failed()

    def _failed(self) -> bool:
        return any(t.done() and not t.cancelled() and t.exception() is not None for t in self._tasks.values())

    # --- intake ----------------------------------------------------------------------------

    async def _intake(self) -> None:
        reclaim_every_s = max(0.05, self.config.lease_s / 4)
        next_reclaim = 0.0
        while not self.is_draining:
            raise_if_cancelled()
            free = self.loop.free
            if free == 0 and self.loop.interactive_free > 0:
                await self._intake_reserve()
                continue
            if free == 0:
                self.loop.slot_freed.clear()
                try:
                    await asyncio.wait_for(self.loop.slot_freed.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                continue
            entries: list[Entry] = []
            try:
                if time.monotonic() >= next_reclaim:
                    reclaimed = await self.consumer.reclaim(free)
                    self.metrics.leases_reclaimed(self._lane_of.get(e.ref.stream, "unknown") for e in reclaimed)
                    entries += reclaimed
                    next_reclaim = time.monotonic() + reclaim_every_s
                if len(entries) < free:
                    entries += await self.consumer.read(free - len(entries))
            except REDIS_DOWN as e:
                await _redis_down("intake", e)  # entries already taken are still admitted below
            if entries:
                self.loop.reserve(len(entries))
                await asyncio.gather(*(self._admit(entry) for entry in entries))

    async def _intake_reserve(self) -> None:
        """Every slot is busy: take interactive entries only, for the engine to preempt a lower lane for.

        It polls instead of blocking: a worker with a free slot, blocked on the lanes, is served a new
        entry by Redis at once, so a busy worker takes only what no idle one did.
        """
        self.loop.slot_freed.clear()
        try:
            await asyncio.wait_for(self.loop.slot_freed.wait(), timeout=RESERVE_POLL_S)
            return  # a slot freed: the weighted read takes over
        except TimeoutError:
            pass
        count = self.loop.interactive_free
        if self.loop.free or not count or self.is_draining:
            return
        try:
            entries = await self.consumer.read_interactive(count)
        except REDIS_DOWN as e:
            await _redis_down("intake", e)
            return
        if entries:
            self.loop.reserve(len(entries))
            await asyncio.gather(*(self._admit(entry) for entry in entries))

    async def _admit(self, entry: Entry) -> None:
        try:
            await self._admit_one(entry)
        except Exception:
            # Left pending and unrenewed: redelivered after the lease, counted against max_deliveries.
            log.exception("admitting %s failed", entry.ref)
        finally:
            self.loop.release(1)

    async def _admit_one(self, entry: Entry) -> None:
        ref = entry.ref
        if entry.fields is None:
            await self.store.ack(ref)  # deleted while pending: nothing left to run
            return
        created_at = int(ref.entry_id.split("-", 1)[0]) / 1000  # the stream entry id is its XADD time
        raw = entry.fields.get(b"job")
        if raw is None:
            await self.store.dead_letter_entry(ref, "entry has no 'job' field", entry.fields)
            self.metrics.dead_lettered(self._lane_of.get(ref.stream, "unknown"), "no_job_field")
            return
        try:
            spec = JobSpec.unpack(raw)
        except JobValidationError as e:
            job_id, traceparent = _recover_id(raw), _recover_traceparent(raw)
            reason = f"invalid job: {e}"
            lane = self._lane_of.get(ref.stream, "unknown")
            self.metrics.dead_lettered(lane, "invalid_job")
            if job_id is None:
                log.warning("%s: %s; dead-lettered", ref, reason, extra={"entry": str(ref), "dead_letter": "invalid_job"})
                await self.store.dead_letter_entry(ref, reason, entry.fields)
                return
            with job_context(job_id, span_of_traceparent(traceparent)):
                # Only an id nobody used yet gets a failed record: a real job with this id is left as it is.
                won = await self.store.commit(Outcome(job_id, JobStatus.FAILED, ref, dead_reason=reason,
                                                      dead_payload=raw, traceparent=traceparent, is_new_record_only=True,
                                                      error={"type": "invalid_job", "field": e.field, "message": str(e)}))
                log.warning("job %s: %s; dead-lettered%s", job_id, reason,
                            " and failed" if won else " (the id names an existing job, which is left alone)",
                            extra={"entry": str(ref), "lane": lane, "dead_letter": "invalid_job"})
                if won:
                    self.metrics.job_finished_unrun(lane, JobStatus.FAILED, created_at)
            return
        if spec.lane != entry.lane:
            # The stream it waited in is its lane: a direct producer may leave `lane` out (standard by default).
            spec = dataclasses.replace(spec, lane=entry.lane)
        # Every line about this job names it and its trace (the message's context until the job's own span opens).
        with job_context(spec.id, span_of_traceparent(spec.traceparent)):
            await self._admit_spec(spec, entry, raw, created_at)

    async def _admit_spec(self, spec: JobSpec, entry: Entry, raw: bytes, created_at: float) -> None:
        ref = entry.ref
        lane = spec.lane.value
        running = self.loop.jobs.get(spec.id)
        if running is not None and running.entry == ref:
            # Our own reclaim took our entry after a late renewal: the job still runs here, and the claim renewed it.
            log.info("job %s: reclaimed our own running entry %s; it keeps running", spec.id, ref)
            return
        if entry.deliveries > 1:
            log.info("job %s: reclaimed from %s (delivery %d): its previous worker stopped renewing or handed it back",
                     spec.id, ref, entry.deliveries, extra={"entry": str(ref), "lane": lane, "delivery": entry.deliveries})
        if entry.deliveries > self.config.max_deliveries:
            reason = f"delivered {entry.deliveries} times (max_deliveries {self.config.max_deliveries})"
            log.warning("job %s: %s; dead-lettered and failed", spec.id, reason,
                        extra={"entry": str(ref), "lane": lane, "dead_letter": "too_many_deliveries"})
            self.metrics.dead_lettered(spec.lane.value, "too_many_deliveries")
            if await self.store.commit(Outcome(spec.id, JobStatus.FAILED, ref, reply_to=spec.reply_to,
                                               webhook=spec.webhook, traceparent=spec.traceparent, dead_reason=reason,
                                               dead_payload=raw,
                                               error={"type": "too_many_deliveries", "message": reason})):
                self.metrics.job_finished_unrun(spec.lane.value, JobStatus.FAILED, created_at)
            return
        admission = await self.store.admit(spec, ref, created_at, time.time())
        if admission.verdict != "run":
            log.info("job %s: not run (%s, was %s)", spec.id, admission.verdict, admission.previous_status or "new",
                     extra={"entry": str(ref), "lane": lane, "verdict": admission.verdict})
        if admission.verdict in ("terminal", "duplicate"):
            await self.store.ack(ref)
        elif admission.verdict == "cancel":
            await self.store.commit(Outcome(spec.id, JobStatus.CANCELLED, ref, reply_to=spec.reply_to, webhook=spec.webhook,
                                            traceparent=spec.traceparent,
                                            error={"type": "cancelled", "message": "cancelled before it started"}))
            self.metrics.job_finished_unrun(spec.lane.value, JobStatus.CANCELLED, created_at)
        elif admission.verdict == "expire":
            await self.store.commit(Outcome(spec.id, JobStatus.EXPIRED, ref, reply_to=spec.reply_to, webhook=spec.webhook,
                                            traceparent=spec.traceparent,
                                            error={"type": "expired", "message": "deadline passed before the job started"}))
            self.metrics.job_finished_unrun(spec.lane.value, JobStatus.EXPIRED, created_at)
        else:
            assert admission.verdict == "run", admission.verdict
            await self._announce_start(spec, admission)
            self.loop.start(spec, ref, admission.checkpoint, admission.record, admission.checkpoint_logprobs)
            log.info("job %s: admitted from %s (attempt %d, resuming after %d tokens)", spec.id, ref,
                     admission.attempts, len(admission.checkpoint),
                     extra={"entry": str(ref), "lane": lane, "attempt": admission.attempts,
                            "resumed_from": len(admission.checkpoint)})

    async def _announce_start(self, spec: JobSpec, admission: Admission) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.publish(self.keys.events(spec.id), pack({
            "type": "started", "id": spec.id, "worker": self.config.worker_name, "attempts": admission.attempts,
            "resumed_from": len(admission.checkpoint)}))
        if admission.is_first_start and spec.webhook is not None and spec.webhook.wants(WebhookEvent.STARTED):
            view = job_view(admission.record)
            pipe.xadd(self.keys.webhooks, delivery_fields(spec.id, WebhookEvent.STARTED, spec.webhook.url, view,
                                                          traceparent=spec.traceparent))
        await pipe.execute()

    # --- leases, cancellation, heartbeat ----------------------------------------------------------

    async def _leases(self) -> None:
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.config.lease_s / 3)
            by_entry = {job.entry: job_id for job_id, job in self.loop.jobs.items()}
            if not by_entry:
                continue
            try:
                lost = await self.consumer.renew(list(by_entry))
            except REDIS_DOWN as e:
                await _redis_down("lease renewal", e)
                continue
            for ref in lost:
                self.loop.drop(by_entry[ref])

    async def _control(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                # After a dropped connection the next read reconnects and subscribes again.
                message = await self._pubsub.get_message(timeout=1.0)
            except REDIS_DOWN as e:
                await _redis_down("control channel", e)
                continue
            raise_if_cancelled()
            if message is None or message.get("type") != "message":
                continue
            try:
                body = msgpack.unpackb(message["data"], raw=False)
            except Exception:
                log.warning("ignoring a control message that is not msgpack")
                continue
            if isinstance(body, dict) and body.get("type") == "cancel" and isinstance(body.get("id"), str):
                if self.loop.cancel(body["id"]):
                    log.info("job %s: cancelled while running", body["id"])

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self.client.hset(self.keys.workers, self.config.worker_name, pack({
                    "time": time.time(), "running": len(self.loop.jobs), "capacity": self.config.capacity,
                    "draining": self.is_draining}))
            except REDIS_DOWN as e:
                await _redis_down("heartbeat", e)
                continue
            raise_if_cancelled()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    # --- health server ---------------------------------------------------------------------------

    def http_app(self) -> web.Application:
        app = web.Application()
        app[SERVICE_KEY] = self
        app.router.add_get("/healthz", _healthz)
        app.router.add_get("/readyz", _readyz)
        app[METRICS_KEY] = self.metrics
        app.router.add_get("/metrics", metrics_handler)
        return app

    async def start_http(self, host: str, port: int) -> None:
        self._http = web.AppRunner(self.http_app())
        await self._http.setup()
        await web.TCPSite(self._http, host, port).start()


SERVICE_KEY = web.AppKey("service", WorkerService)


async def _healthz(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    healthy = not service._failed()
    return web.json_response({"status": "ok" if healthy else "failed"}, status=200 if healthy else 500)


async def _readyz(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body = {"ready": service.is_ready, "draining": service.is_draining, "running": len(service.loop.jobs),
            "capacity": service.config.capacity}
    return web.json_response(body, status=200 if service.is_ready else 503)


async def _redis_down(loop: str, error: Exception) -> None:
    log.warning("worker %s: Redis unreachable (%s); retrying in %.1fs", loop, error, REDIS_RETRY_S)
    raise_if_cancelled()
    await asyncio.sleep(REDIS_RETRY_S)


def _loose_map(raw: bytes) -> dict[Any, Any] | None:
    """An invalid ``job`` field read as loosely as possible: JSON (redis-cli producers) or msgpack."""
    try:
        data = json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    return data if isinstance(data, dict) else None


def _recover_traceparent(raw: bytes) -> str | None:
    """The ``traceparent`` of an invalid message, when one can be read, so its lines join the producer's trace."""
    traceparent = (_loose_map(raw) or {}).get("traceparent")
    return traceparent if isinstance(traceparent, str) else None


def _recover_id(raw: bytes) -> str | None:
    """The job id of an invalid message, when one can be read, so its record can be marked failed."""
    job_id = (_loose_map(raw) or {}).get("id")
    if isinstance(job_id, str) and job_id and len(job_id) <= 128 and job_id.isprintable() and " " not in job_id:
        return job_id
    return None
