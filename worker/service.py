"""The worker process: Redis wiring, intake, leases, cancellation, heartbeat, health server, shutdown.

Background tasks are owned here (one reference each, reaped, an exception
stops the worker). Shutdown runs in two phases: stop intake and let in-flight
jobs finish within the grace period, then checkpoint the rest and hand their
entries back so another worker resumes them at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Coroutine
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from aiohttp import web

from scheduler.protocol import state_machine
from scheduler.protocol.keys import Keys
from scheduler.protocol.lanes import Lane
from scheduler.protocol.redis_client import is_refusal
from scheduler.protocol.worker_heartbeats import heartbeat_time, recent_heartbeats
from scheduler.runtime.outage_log import describe
from scheduler.runtime.tasks import raise_if_cancelled
from scheduler.telemetry.otel import Telemetry
from worker.config import WorkerConfig
from worker.consumer import Entry, LaneConsumer
from worker.engine.wire import EngineRunner
from worker.intake import EntryIntake
from worker.job_loop import JobLoop
from worker.job_store import JobStore, pack
from worker.metrics import METRICS_KEY, WorkerMetrics, metrics_handler
from worker.redis_errors import REDIS_ERRORS, REDIS_RETRY_S, is_redis_down, outage_log

log = logging.getLogger(__name__)

RESERVE_POLL_S = 0.02
"""How often a worker with every slot busy looks for interactive entries for its reserve."""


MAX_NAME_CHECK_INTERVAL_S = 60.0
"""The longest heartbeat interval of another worker the name check waits out (a value read from Redis)."""


class WorkerNameTaken(Exception):
    """Another live worker under the same key prefix has this worker's name."""


def claim_ttl_ms(heartbeat_interval_s: float, redis_timeout_s: float) -> int:
    """How long a worker's claim on its name outlives its last renewal: three heartbeat intervals, and at least
    one interval and a Redis timeout, so that a slow beat does not let it lapse under a live worker."""
    return max(1, round(1000 * max(3 * heartbeat_interval_s, heartbeat_interval_s + redis_timeout_s)))


async def claim_name(client: aioredis.Redis, keys: Keys, name: str, token: str, ttl_ms: int) -> None:
    """Take the claim on `name` for the worker holding `token`, or raise WorkerNameTaken where another live
    worker holds it. `check_name_is_free` (before the model loads) reads heartbeats, so two workers started under
    one name at the same moment both pass it; the claim, set only where absent, lets one through. A claim held
    by another is waited out once: a killed worker's lapses (its heartbeats renewed it), a live one's does not."""
    key = keys.worker_claim(name)
    if await client.set(key, token, nx=True, px=ttl_ms):
        return
    left_ms = await client.pttl(key)
    log.info("another worker holds the claim on this worker's name %r: waiting %.1fs to see whether it is alive",
             name, max(left_ms, 0) / 1000)
    await asyncio.sleep(max(left_ms, 0) / 1000 + 0.05)
    if await client.set(key, token, nx=True, px=ttl_ms):
        return
    raise WorkerNameTaken(
        f"another live worker is named {name!r} under the key prefix {keys.prefix!r} (it holds the name's claim, "
        f"renewed by its heartbeats): give each worker its own --worker-name (the default, host-pid-random, is "
        "unique)")


async def renew_name(client: aioredis.Redis, keys: Keys, name: str, token: str, ttl_ms: int) -> None:
    """Renew the claim on `name` of the worker holding `token`; raise WorkerNameTaken where another holds it now
    (this worker's claim lapsed, a Redis outage say, and another took the name meanwhile)."""
    if not await client.eval(state_machine.RENEW_CLAIM, 1, keys.worker_claim(name), token, ttl_ms):
        raise WorkerNameTaken(f"another worker took the name {name!r} under the key prefix {keys.prefix!r} while "
                              "this one's claim had lapsed: stopping, to leave it the name")


async def release_name(client: aioredis.Redis, keys: Keys, name: str, token: str) -> None:
    """Give the claim on `name` back, if it is still the worker's holding `token`."""
    await client.eval(state_machine.RELEASE_KEY, 1, keys.worker_claim(name), token)


async def check_name_is_free(client: aioredis.Redis, keys: Keys, name: str, heartbeat_interval_s: float) -> None:
    """Raise WorkerNameTaken when another live worker under `keys`' prefix is named `name`: both would read as one
    consumer of the group, one heartbeat would hide the other's slots from autoscalers, and a dead one's jobs
    would count as held by the live one. A heartbeat under the name may also be a killed worker's, left behind (a
    restart under the same name): it is taken as a live worker's only when it is renewed within one and a half
    heartbeat intervals (the longer of this worker's and the one it names). Clocks are not compared: hosts'
    may differ. A Redis that cannot be reached now is not checked (the worker waits for it later)."""
    try:
        first = await heartbeat_time(client, keys.workers, name)
        if first is None:
            return
        interval_s = max(heartbeat_interval_s, min(first.interval_s or 0.0, MAX_NAME_CHECK_INTERVAL_S))
        log.info("a heartbeat under this worker's name %r is in Redis: waiting %gs to see whether its worker is "
                 "alive", name, 1.5 * interval_s)
        await asyncio.sleep(1.5 * interval_s)
        second = await heartbeat_time(client, keys.workers, name)
    except REDIS_ERRORS as e:
        if is_refusal(e):
            raise
        return
    if second is not None and second.time != first.time:
        raise WorkerNameTaken(
            f"another live worker is named {name!r} under the key prefix {keys.prefix!r} (its heartbeat was "
            f"renewed within {1.5 * interval_s:g}s): give each worker its own --worker-name (the default, "
            "host-pid-random, is unique)")


class WorkerService:
    def __init__(self, config: WorkerConfig, engine: EngineRunner, client: aioredis.Redis,
                 telemetry: Telemetry | None = None) -> None:
        """``engine``: an ``EngineProcess``, or an in-process ``Engine`` on its thread (``EngineThread``)."""
        self.config = config
        self.engine = engine
        self.client = client
        self.started_s = time.time()
        """When this worker started: its heartbeat's `started`, which the OpenAI API's models list gives as `created`."""
        self.keys = Keys(config.key_prefix)
        self.store = JobStore(client, self.keys, worker=config.worker_name, result_ttl_s=config.result_ttl_s,
                                 reply_maxlen=config.reply_maxlen, dead_maxlen=config.dead_maxlen)
        self.consumer = LaneConsumer(client, self.keys, config.worker_name, {lane: config.weight(lane) for lane in Lane},
                                     lease_ms=config.lease_ms, read_block_ms=config.read_block_ms,
                                     max_deliveries=config.max_deliveries)
        # ``telemetry`` (built by the CLI from the OTEL_* variables) stays the caller's to shut down.
        self.metrics = WorkerMetrics(telemetry, max_num_seqs=self.engine.max_num_seqs,
                                     max_tenant_labels=config.max_tenant_labels)
        self._lane_of = {self.keys.lane(lane): lane.value for lane in Lane}
        self.job_loop = JobLoop(self.engine, self.store, client, self.keys, config, self.metrics)
        self.intake = EntryIntake(config, client, self.keys, self.store, self.job_loop, self.metrics, self._lane_of)
        self.is_ready = False
        self.is_draining = False
        self.stopped = asyncio.Event()
        """Set when the worker should stop: a signal, or a background task that failed."""
        self._stray_walk_failed = False
        """Whether Redis refused this worker's walk for stray tenant streams (said once)."""
        self.reclaim_now = asyncio.Event()
        """A worker handed entries back (control message ``handback``): reclaim before reading new entries."""
        self.hand_back_now = asyncio.Event()
        """Set to end the shutdown's grace period at once: running jobs are checkpointed and handed back."""
        self.is_redis_writable = False
        """Whether the last heartbeat was written: not before the first, nor while Redis is unreachable or at
        maxmemory (``/readyz``)."""
        self.has_stranded_jobs = False
        """The shutdown could not hand its running jobs back (Redis unavailable): they wait for the lease."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._refused: BaseException | None = None
        """What Redis refused this worker's user (an ACL it lacks), found admitting an entry: the worker stops."""
        self._crashed = False
        """A background task (the engine's loop, say) or an admission died, also during the drain."""
        self._outages = outage_log(log)
        self._lost_reads = True
        """A read may have been delivered entries whose reply never came (a read failed), or an earlier process
        of this worker's name left some: look for this consumer's own pending entries before the next read."""
        self._redis_down_at = -math.inf
        """When a loop last found Redis unavailable (monotonic)."""
        self._redis_back_at = -math.inf
        """When the intake's loop first reached Redis again after `_redis_down_at` (monotonic): for a lease after
        that, only handed-back entries are reclaimed, since every other worker's leases lapsed during the outage
        too and each worker renews them within `REDIS_RETRY_S` of reaching Redis again (`_leases`)."""
        self._pubsub: Any = None
        self._http: web.AppRunner | None = None
        self._claim_token = os.urandom(16).hex()
        self._claim_ttl_ms = claim_ttl_ms(config.heartbeat_interval_s, config.redis_timeout_s)
        self._has_claim = False
        """Whether this worker holds its name's claim (`claim_name`): only then are the name's heartbeat and claim
        its own to renew and to remove."""

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await claim_name(self.client, self.keys, self.config.worker_name, self._claim_token, self._claim_ttl_ms)
        self._has_claim = True
        await self.consumer.ensure_groups()
        self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        # Subscribe before reading any entry: a cancel published after admission is then never missed.
        await self._pubsub.subscribe(self.keys.control)
        self.metrics.watch_streams(self.client, self.keys)
        self._spawn("engine", self.job_loop.run())
        self._spawn("control", self._control())
        self._spawn("leases", self._leases())
        await self._warn_of_other_workers()
        # The first heartbeat is in Redis before the worker says it is ready: a gateway asked right after
        # (GET /v1/models, /readyz) then knows this worker and its model.
        await self._beat()
        self.is_redis_writable = True
        self._spawn("heartbeat", self._heartbeat())
        # Listening before any entry is read: a port that cannot be had stops the worker holding no job. (The
        # worker's CLI starts it earlier, before it waits for Redis.)
        if self.config.metrics_port and self._http is None:
            await self.start_http(self.config.metrics_host, self.config.metrics_port)
        self._spawn("intake", self._intake())
        self.is_ready = True
        log.info("worker %s ready (capacity %d)", self.config.worker_name, self.config.capacity)

    async def shutdown(self) -> None:
        """Stop intake, drain to the grace deadline, hand back the rest, then cancel.

        With Redis unavailable the hand-back cannot be written: the jobs are left as a killed worker leaves them
        (reclaimed after the lease, from their last checkpoint) and the rest of the shutdown goes on, so the
        process still ends (``has_stranded_jobs``) and its engine process with it."""
        self.is_draining = True
        self.intake.is_draining = True
        # Commits waiting for Redis keep trying for a lease more; then their entries are left to the lease.
        self.job_loop.commits.give_up_at = time.monotonic() + self.config.shutdown_grace_s + self.config.lease_s
        self.is_ready = False
        try:
            await self._drain()
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._tasks.clear()
            if self._pubsub is not None:
                await self._pubsub.aclose()
            try:
                if self._has_claim:  # else the heartbeat under this name is another live worker's
                    async with asyncio.timeout(self.config.lease_s):
                        await self.client.hdel(self.keys.workers, self.config.worker_name)
                        await release_name(self.client, self.keys, self.config.worker_name, self._claim_token)
            except REDIS_ERRORS as e:
                log.warning("worker %s: could not leave %s (%s)", self.config.worker_name, self.keys.workers,
                            describe(e))
            if self._http is not None:
                await self._http.cleanup()
            await self.job_loop.aclose()
            if self.metrics.streams is not None:
                await self.metrics.streams.aclose()
            self.metrics.close()

    async def _drain(self) -> None:
        intake = self._tasks.pop("intake", None)
        if intake is not None:
            await asyncio.gather(intake, return_exceptions=True)
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.job_loop.jobs and time.monotonic() < deadline and not self._failed() and not self.hand_back_now.is_set():
            self.job_loop.slot_freed.clear()
            try:
                await asyncio.wait_for(self.job_loop.slot_freed.wait(), timeout=min(0.2, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                pass
        if self.job_loop.jobs:
            num_jobs = len(self.job_loop.jobs)
            try:
                # A Redis that does not answer at all (a network cut drops packets) holds the writes no longer
                # than a lease: by then the jobs are another worker's to reclaim anyway.
                async with asyncio.timeout(self.config.lease_s):
                    jobs = await self.job_loop.checkpoint_all()
                    # Stopping because the engine or a loop failed is no clean stop: those deliveries count. A
                    # Redis that refuses this worker's user says nothing of its jobs: their hand-back is clean.
                    await self.consumer.hand_back(jobs, is_clean=not self._crashed_here())
                    # Workers with a free slot take them over now, ahead of newer entries, not at their next
                    # periodic reclaim (every lease_s / 4).
                    await self.client.publish(self.keys.control,
                                              pack({"type": "handback", "worker": self.config.worker_name}))
                log.info("handed back %d unfinished jobs with their checkpoints", len(jobs))
            except REDIS_ERRORS as e:  # the timeout's TimeoutError is an OSError
                if not is_redis_down(e):
                    raise
                self.has_stranded_jobs = True
                log.error("could not hand back %d unfinished jobs, Redis unavailable (%s): they are reclaimed after "
                          "the lease, from their last checkpoint", num_jobs, describe(e))
        await self.job_loop.wait_commits()
        if self.job_loop.commits.num_given_up:
            # Finished jobs whose results Redis never took: they run again after the lease, as a killed worker's do.
            self.has_stranded_jobs = True

    async def _redis_down(self, loop: str, error: Exception) -> None:
        """A background loop found Redis unavailable: wait and let it try again, instead of stopping the worker.
        Any other Redis error is raised again."""
        if not is_redis_down(error):
            raise error
        self._redis_down_at = time.monotonic()
        self._outages.warn(f"worker {self.config.worker_name} {loop}", error)
        raise_if_cancelled()
        await asyncio.sleep(REDIS_RETRY_S)

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
            self._crashed = True  # kept past the shutdown, which forgets its tasks: the process exits 1
            self.stopped.set()

    @property
    def has_failed(self) -> bool:
        """A background task died: the worker stops, and its process exits non-zero."""
        return self._failed()

    def _failed(self) -> bool:
        return self._refused is not None or self._crashed_here()

    def _crashed_here(self) -> bool:
        """A failure of this worker's own (not Redis refusing it): its hand-back is no clean stop."""
        return self._crashed or any(
            t.done() and not t.cancelled() and t.exception() is not None for t in self._tasks.values())

    # --- intake ----------------------------------------------------------------------------

    async def _intake(self) -> None:
        """Read entries as slots free up and admit each in a task of its own, so that one waiting on Redis (a
        START refused at maxmemory, say) holds its slot only, not the reads of every lane; on the way out the
        admissions under way end first (those waiting on Redis give up when the worker drains)."""
        admissions: set[asyncio.Task[None]] = set()
        try:
            await self._read_entries(admissions)
        except asyncio.CancelledError:
            for task in admissions:
                task.cancel()
            raise
        finally:
            await asyncio.gather(*admissions, return_exceptions=True)

    def _admit(self, entries: list[Entry], admissions: set[asyncio.Task[None]]) -> None:
        self.job_loop.reserve(len(entries))
        for entry in entries:
            task = asyncio.create_task(self.intake.take(entry), name=f"admitting {entry.ref}")
            admissions.add(task)
            task.add_done_callback(admissions.discard)
            task.add_done_callback(self._admission_ended)

    def _admission_ended(self, task: asyncio.Task[None]) -> None:
        """An admission raises when Redis refuses this worker's user a command it needs (ACL): no entry can start
        here, so the worker stops, exiting non-zero, instead of using up every entry's deliveries. Any other
        error it raises is a failure of the worker's own, as a background task's (`_reap`)."""
        error = None if task.cancelled() else task.exception()
        if error is None or not is_refusal(error):
            self._reap(task)
            return
        if self._refused is None:
            log.error("%s: Redis refuses this worker's user a command it needs (%s); stopping the worker",
                      task.get_name(), error)
            self._refused = error
        self.stopped.set()

    async def _read_entries(self, admissions: set[asyncio.Task[None]]) -> None:
        reclaim_every_s = max(0.05, self.config.lease_s / 4)
        next_reclaim = 0.0
        while not self.is_draining:
            raise_if_cancelled()
            free = self.job_loop.free
            if free == 0 and self.job_loop.interactive_free > 0:
                await self._intake_reserve(admissions)
                continue
            if free == 0:
                self.job_loop.slot_freed.clear()
                try:
                    await asyncio.wait_for(self.job_loop.slot_freed.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                continue
            entries: list[Entry] = []
            try:
                if self._lost_reads:
                    known = {*(job.entry for job in self.job_loop.jobs.values()), *self.intake.admitting,
                             *self.job_loop.commits.retrying}
                    entries += await self.consumer.own_pending(free, known)
                    self._lost_reads = False
                if time.monotonic() >= next_reclaim:
                    await self._adopt_strays(reclaim_every_s)
                if time.monotonic() >= next_reclaim or self.reclaim_now.is_set():
                    self.reclaim_now.clear()
                    after_outage = time.monotonic() - self._reached_redis_after_outage() < self.config.lease_s
                    reclaimed = await self.consumer.reclaim(free, handed_back_only=after_outage)
                    self.metrics.leases_reclaimed(e.lane.value for e in reclaimed)
                    entries += reclaimed
                    next_reclaim = time.monotonic() + reclaim_every_s
                    if len(reclaimed) >= free:
                        # It took as many as it had slots for: there may be more (a worker handed back more jobs
                        # than were free here), each to go before any newer entry as the next slot frees.
                        self.reclaim_now.set()
                if len(entries) < free:
                    entries += await self.consumer.read(free - len(entries))
            except REDIS_ERRORS as e:
                # A read whose reply never came (a timeout, a dropped connection) may have been delivered to us
                # all the same; one Redis answered with an error (maxmemory, say) delivered nothing.
                self._lost_reads = self._lost_reads or not isinstance(e, ResponseError)
                await self._redis_down("intake", e)  # entries already taken are still admitted below
            if entries:
                self._admit(entries, admissions)

    def _reached_redis_after_outage(self) -> float:
        """When this loop first reached Redis after the last outage any loop found (monotonic; now, the first
        time after it): the start of the lease in which the other workers' lapsed leases are theirs to renew."""
        if self._redis_back_at < self._redis_down_at:
            self._redis_back_at = time.monotonic()
        return self._redis_back_at

    async def _adopt_strays(self, interval_s: float) -> None:
        """This worker's slice, when it is its turn, of the fleet's walk for tenant streams outside the active sets.
        An error Redis answers (an ACL without SCAN, say) is logged once and the walk left to the others: reading
        and reclaiming go on."""
        try:
            await self.consumer.tenants.adopt_strays(self.config.worker_name, max(1, int(interval_s * 1000)))
        except ResponseError as e:
            if is_redis_down(e):
                raise
            if not self._stray_walk_failed:
                log.warning("worker %s cannot walk the key space for tenant streams outside the active sets (%s); "
                            "it leaves that to other workers", self.config.worker_name, e)
            self._stray_walk_failed = True

    async def _intake_reserve(self, admissions: set[asyncio.Task[None]]) -> None:
        """Every slot is busy: take interactive entries only, for the engine to preempt a lower lane for.

        It polls instead of blocking: a worker with a free slot, blocked on the lanes, is served a new
        entry by Redis at once, so a busy worker takes only what no idle one did.
        """
        self.job_loop.slot_freed.clear()
        try:
            await asyncio.wait_for(self.job_loop.slot_freed.wait(), timeout=RESERVE_POLL_S)
            return  # a slot freed: the weighted read takes over
        except TimeoutError:
            pass
        count = self.job_loop.interactive_free
        if self.job_loop.free or not count or self.is_draining:
            return
        try:
            entries = await self.consumer.read_interactive(count)
        except REDIS_ERRORS as e:
            await self._redis_down("intake", e)
            return
        if entries:
            self._admit(entries, admissions)

    # --- leases, cancellation, heartbeat ----------------------------------------------------------

    async def _leases(self) -> None:
        retrying = False
        while True:
            raise_if_cancelled()
            if not retrying:
                await asyncio.sleep(self.config.lease_s / 3)
            retrying = False
            by_entry = {job.entry: job_id for job_id, job in self.job_loop.jobs.items()}
            # Also the entries whose admission or commit waits for an unavailable Redis.
            waiting = self.intake.admitting | self.job_loop.commits.retrying
            if not by_entry and not waiting:
                continue
            try:
                lost = await self.consumer.renew({*by_entry, *waiting})
            except REDIS_ERRORS as e:
                # Tried again `REDIS_RETRY_S` later, not a third of a lease: the leases lapsed in the outage are
                # renewed as soon as Redis is back, before another worker's grace after it (`_redis_back_at`) ends.
                await self._redis_down("lease renewal", e)
                retrying = True
                continue
            for ref in lost:
                if ref in by_entry:
                    self.job_loop.drop(by_entry[ref], "its entry is no longer pending here (another worker reclaimed it "
                                                      "after a lapsed lease, or Redis lost the lane's group)")
                self.intake.admitting.discard(ref)
                self.job_loop.commits.retrying.discard(ref)

    async def _control(self) -> None:
        assert self._pubsub is not None
        while True:
            try:
                # After a dropped connection the next read reconnects and subscribes again.
                message = await self._pubsub.get_message(timeout=1.0)
            except REDIS_ERRORS as e:
                await self._redis_down("control channel", e)
                continue
            raise_if_cancelled()
            if message is None or message.get("type") != "message":
                continue
            try:
                body = msgpack.unpackb(message["data"], raw=False)
            except Exception:
                log.warning("ignoring a control message that is not msgpack")
                continue
            if isinstance(body, dict) and body.get("type") == "handback":
                self.reclaim_now.set()
            elif isinstance(body, dict) and body.get("type") == "cancel" and isinstance(body.get("id"), str):
                self.job_loop.cancel(body["id"])  # a job not running here is no concern of this worker

    async def _beat(self) -> None:
        try:
            await renew_name(self.client, self.keys, self.config.worker_name, self._claim_token, self._claim_ttl_ms)
        except WorkerNameTaken:
            self._has_claim = False  # the name's heartbeat and claim are the other worker's now
            raise
        now = time.time()
        # `async with`: a beat cut short (a Redis stall past the heartbeat's timeout) still gives its connection back.
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.workers, self.config.worker_name, pack({
                "time": now, "started": self.started_s, "running": len(self.job_loop.jobs),
                "capacity": self.config.capacity,
                "max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "builtin_model": self.config.engine.model is None,
                "model": self.config.model_name, "lease_s": self.config.lease_s,
                "heartbeat_interval_s": self.config.heartbeat_interval_s,
                "draining": self.is_draining}))
            pipe.hset(self.keys.models, self.config.model_name, repr(now))
            await pipe.execute()

    async def _warn_of_other_workers(self) -> None:
        """Say so when live workers under this key prefix serve another model (the lanes are shared, so each
        would answer the other's requests, and the OpenAI routes would name the model asked for), or hold their
        jobs on another lease: a worker reclaims entries idle for its own lease, and one renews its entries
        every third of its own, so after a stall longer than the shorter lease (at once, where it is under a third
        of the other) the one with the shorter lease takes the other's running jobs as lost and runs them again
        from their checkpoints."""
        beats = await recent_heartbeats(self.client, self.keys.workers,
                                        max_age_s=3 * self.config.heartbeat_interval_s + 1, now=time.time(),
                                        besides=self.config.worker_name)
        others = {beat["model"] for beat in beats
                  if isinstance(beat.get("model"), str) and beat["model"] != self.config.model_name}
        if others:
            log.warning("worker %s serves %r, but live workers under the key prefix %r serve %s: they share its "
                        "lanes, so jobs meant for one model are run by another; give each model its own "
                        "--key-prefix", self.config.worker_name, self.config.model_name, self.keys.prefix,
                        sorted(others))
        leases = {float(beat["lease_s"]) for beat in beats
                  if isinstance(beat.get("lease_s"), (int, float)) and not isinstance(beat["lease_s"], bool)
                  and beat["lease_s"] != self.config.lease_s}
        if leases:
            log.warning("worker %s holds its jobs on a %gs lease, but live workers under the key prefix %r hold "
                        "theirs on %s: a worker takes jobs idle for its own lease as lost, and renews its own every "
                        "third of its lease, so after a stall longer than the shorter lease (at once, where it is "
                        "under a third of another) the shorter lease's workers run the others' jobs again while "
                        "they still run; give every worker the same --lease-s", self.config.worker_name,
                        self.config.lease_s, self.keys.prefix, ", ".join(f"{lease:g}s" for lease in sorted(leases)))

    async def _heartbeat(self) -> None:
        """A heartbeat every interval after the first (`start` writes that one)."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self._beat()
            except REDIS_ERRORS as e:
                self.is_redis_writable = False
                await self._redis_down("heartbeat", e)  # and the next beat an interval later
            else:
                self.is_redis_writable = True
                self._outages.recovered()
            raise_if_cancelled()

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
        # Its routes are probes and scrapes, every few seconds each: no access line for them (aiohttp's own, in
        # another shape than carpool's, would be most of the worker's log).
        self._http = web.AppRunner(self.http_app(), access_log=None)
        await self._http.setup()
        await web.TCPSite(self._http, host, port).start()


SERVICE_KEY = web.AppKey("service", WorkerService)


async def _healthz(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    healthy = not service._failed()
    return web.json_response({"status": "ok" if healthy else "failed"}, status=200 if healthy else 500)


async def _readyz(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    # Ready while it can take jobs: started, not draining, and Redis taking its writes (its last heartbeat).
    is_ready = service.is_ready and service.is_redis_writable
    # Its name and pid say whose answer this is: `carpool up` waits for its own worker's, not another server's.
    body = {"ready": is_ready, "draining": service.is_draining, "running": len(service.job_loop.jobs),
            "capacity": service.config.capacity, "redis": "ok" if service.is_redis_writable else "unavailable",
            "worker": service.config.worker_name, "pid": os.getpid()}
    return web.json_response(body, status=200 if is_ready else 503)


