"""Lane depth, pending entries and dead letters, read from Redis in the background for gauges.

Gauge callbacks run inside a ``/metrics`` scrape and must not wait on Redis,
so a poller owned by the process refreshes a snapshot every few seconds
(XLEN and XPENDING per lane, XLEN of the dead-letter stream) and the
callbacks read the snapshot. Takes any asyncio Redis client (redis-py's
``redis.asyncio.Redis``) by duck typing, so this module imports no client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from scheduler.protocol.keys import CONSUMER_GROUP, Keys
from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.tenants import named_tenants
from scheduler.protocol.worker_heartbeats import DEFAULT_HEARTBEAT_MAX_AGE_S, recent_workers
from scheduler.runtime.outage_log import OutageLog
from scheduler.runtime.tasks import cancel_and_reap, raise_if_cancelled
from scheduler.telemetry.metric_schema import A_LANE

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 5.0


@dataclass
class StreamSnapshot:
    depth: dict[Lane, int] = field(default_factory=lambda: {lane: 0 for lane in LANES})
    pending: dict[Lane, int] = field(default_factory=lambda: {lane: 0 for lane in LANES})
    dead: int = 0
    unheld: dict[Lane, int] = field(default_factory=lambda: {lane: 0 for lane in LANES})
    """Pending entries delivered to a worker whose heartbeat stopped (`held_by_others` of the live workers)."""
    pending_by_consumer: dict[Lane, dict[str, int]] = field(default_factory=lambda: {lane: {} for lane in LANES})
    """Each lane's pending entries by the consumer (worker name) they were delivered to."""

    def held_by_others(self, lane: Lane, consumers: Iterable[str]) -> int:
        """A lane's pending entries delivered to consumers other than `consumers` (workers no longer alive)."""
        live = set(consumers)
        return sum(n for name, n in self.pending_by_consumer[lane].items() if name not in live)


class StreamStats:
    """Owns one polling task; ``start()`` it once the Redis client exists, ``await aclose()`` at shutdown."""

    def __init__(self, redis: Any, keys: Keys, *, interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 heartbeat_max_age_s: float = DEFAULT_HEARTBEAT_MAX_AGE_S) -> None:
        assert interval_s > 0
        self._redis = redis
        self._keys = keys
        self._interval_s = interval_s
        self._heartbeat_max_age_s = heartbeat_max_age_s
        self.snapshot: StreamSnapshot | None = None
        """The counts of the last refresh; None before the first and after one that failed, when the gauges
        report nothing rather than numbers Redis no longer stands behind (a backlog read as gone, or frozen)."""
        self._task: asyncio.Task[None] | None = None
        self._outages = OutageLog(log, retry_s=interval_s)

    async def refresh(self) -> StreamSnapshot:
        """Read every count (`read_stream_counts`), and which workers are alive, and swap the snapshot in."""
        snapshot = await read_stream_counts(self._redis, self._keys)
        live = await recent_workers(self._redis, self._keys.workers, max_age_s=self._heartbeat_max_age_s,
                                    now=time.time())
        snapshot.unheld = {lane: snapshot.held_by_others(lane, live) for lane in LANES}
        self.snapshot = snapshot
        return self.snapshot

    def start(self) -> None:
        assert self._task is None, "StreamStats already started"
        self._task = asyncio.create_task(self._poll(), name="carpool-stream-stats")

    async def aclose(self) -> None:
        """Stop polling; re-raises whatever ended the task other than cancellation."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_reap(task)

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
                self._outages.recovered()
            except (ConnectionError, OSError, TimeoutError) as e:
                # A Redis outage must not end monitoring; the gauges go silent until a refresh succeeds.
                self.snapshot = None
                self._outages.warn("lane gauges' refresh", e)
            except Exception as e:  # redis-py's own error types, which this module does not import
                if type(e).__module__.split(".")[0] != "redis":
                    raise
                self.snapshot = None
                self._outages.warn("lane gauges' refresh", e)
            raise_if_cancelled()
            await asyncio.sleep(self._interval_s)

    # Gauge callbacks: read the snapshot only, and report nothing without one.
    def observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        snapshot = self.snapshot
        return [] if snapshot is None else [Observation(n, {A_LANE: lane.value}) for lane, n in snapshot.depth.items()]

    def observe_pending(self, options: CallbackOptions) -> Iterable[Observation]:
        snapshot = self.snapshot
        return [] if snapshot is None else [Observation(n, {A_LANE: lane.value})
                                            for lane, n in snapshot.pending.items()]

    def observe_unheld(self, options: CallbackOptions) -> Iterable[Observation]:
        snapshot = self.snapshot
        return [] if snapshot is None else [Observation(n, {A_LANE: lane.value})
                                            for lane, n in snapshot.unheld.items()]

    def observe_dead(self, options: CallbackOptions) -> Iterable[Observation]:
        return [] if self.snapshot is None else [Observation(self.snapshot.dead)]


async def read_stream_counts(redis: Any, keys: Keys) -> StreamSnapshot:
    """Each lane's entries (XLEN) and delivered-but-unacknowledged ones (XPENDING), over its stream and its
    active tenants' streams, and the dead-letter stream's length, in two round trips.

    Workers and the tenant routing delete the entries they acknowledge or move, so a lane's depth less its
    pending entries is what waits for a worker."""
    # `async with`: a read cut short (a Redis stall past its caller's timeout) still gives its connection back.
    async with redis.pipeline(transaction=False) as pipe:
        for lane in LANES:
            pipe.smembers(keys.lane_tenants(lane))
        members = await pipe.execute(raise_on_error=False)
    streams: list[tuple[Lane, str]] = []
    for lane, names in zip(LANES, members):
        streams.append((lane, keys.lane(lane)))
        streams += [(lane, keys.tenant_lane(lane, t)) for t in named_tenants(names if isinstance(names, set) else ())]
    async with redis.pipeline(transaction=False) as pipe:
        for _, stream in streams:
            pipe.xlen(stream)
            # XPENDING's summary form; fails with NOGROUP before any worker created the group.
            pipe.xpending(stream, CONSUMER_GROUP)
        pipe.xlen(keys.dead)
        results = await pipe.execute(raise_on_error=False)
    snapshot = StreamSnapshot(dead=_as_count(results[-1]))
    for i, (lane, _) in enumerate(streams):
        snapshot.depth[lane] += _as_count(results[2 * i])
        pending = results[2 * i + 1]
        snapshot.pending[lane] += _as_count(pending.get("pending", 0) if isinstance(pending, dict) else pending)
        for consumer in (pending.get("consumers") or []) if isinstance(pending, dict) else []:
            name = consumer.get("name")
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            by_consumer = snapshot.pending_by_consumer[lane]
            by_consumer[name] = by_consumer.get(name, 0) + _as_count(consumer.get("pending", 0))
    return snapshot


def _as_count(value: object) -> int:
    """A count from a pipeline reply; an error reply (missing stream or group) counts as 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return value
