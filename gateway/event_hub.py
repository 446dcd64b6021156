"""Live job events for this gateway: one shared pub/sub connection fanned out to waiters.

Every long-poll and every server-sent-event stream subscribes to its job's
events channel through the `EventHub`, which keeps a single Redis pub/sub
connection for the whole process (subscribing a channel while someone waits
on it, unsubscribing when the last waiter leaves), so open requests cost
memory, not Redis connections.

While anyone waits, the hub pings Redis over that connection: one that dies
without a word (a network path that drops everything, a frozen server) is
dropped once a ping goes unanswered, and the next read connects and
subscribes every channel again.

A waiter subscribes *before* it re-reads the job record: the hub hands every
waiter its subscription only once Redis has confirmed the channel's SUBSCRIBE
(a waiter joining a channel that is still being subscribed waits too), so a
final event published after that read cannot be missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler.protocol.job import TERMINAL_STATUSES
from scheduler.protocol.job_record import F_STATUS, EventType
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash
from scheduler.runtime.outage_log import OutageLog
from scheduler.runtime.tasks import cancel_and_reap, raise_if_cancelled

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 4096
"""Events buffered per waiter; a reader slower than the model loses token events, never the final one."""

SUBSCRIBE_TIMEOUT_S = 5.0
PING_INTERVAL_S = 5.0
"""While anyone waits, the hub pings Redis over its pub/sub connection this often."""
PONG_TIMEOUT_S = 10.0
"""A ping unanswered this long means the connection died without a word (a dropped network path, a frozen
Redis): the hub drops it, and the next read connects again and subscribes every channel again."""
RECONNECT_S = 0.5
"""How long the hub waits before reading again after its connection failed (the read reconnects)."""

CLOSED = {"type": "closed"}
"""Put in every waiter's queue when the gateway shuts down."""


@dataclass(eq=False)  # identity, so waiters can live in a set
class Subscription:
    channel: str
    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED_EVENTS))
    num_dropped: int = 0

    def offer(self, event: dict[str, Any]) -> None:
        if event.get("type") in (EventType.FINAL, CLOSED["type"]):
            # Terminal events must get through: make room by dropping the oldest token.
            while self.queue.full():
                self.queue.get_nowait()
                self.num_dropped += 1
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.num_dropped += 1


class EventHub:
    """Fans one pub/sub connection out to per-request queues. Start it, then `subscribe`."""

    def __init__(self, redis: aioredis.Redis, ping_interval_s: float = PING_INTERVAL_S,
                 pong_timeout_s: float = PONG_TIMEOUT_S) -> None:
        self._pubsub = redis.pubsub()
        self._ping_interval_s = ping_interval_s
        self._pong_timeout_s = pong_timeout_s
        self.num_reconnects = 0
        """Connections dropped for an unanswered ping."""
        self._subs: dict[str, set[Subscription]] = {}
        # One event per SUBSCRIBE sent, set by the matching confirmation (Redis answers in order).
        self._confirms: dict[str, deque[asyncio.Event]] = {}
        # Per subscribed channel, set once Redis confirmed the SUBSCRIBE: every waiter of the channel waits for it.
        self._live: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()
        self._has_connection = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False
        self._outages = OutageLog(log, retry_s=RECONNECT_S)

    @property
    def num_waiters(self) -> int:
        return sum(len(s) for s in self._subs.values())

    def start(self) -> None:
        assert self._task is None, "EventHub started twice"
        self._task = asyncio.create_task(self._run(), name="event-hub")

    def close_waiters(self) -> None:
        """First shutdown phase: wake every waiter so its request can finish."""
        self._is_closed = True
        for subs in self._subs.values():
            for sub in subs:
                sub.offer(CLOSED)

    async def stop(self) -> None:
        self.close_waiters()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_reap(task)
        await self._pubsub.aclose()

    @asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[Subscription]:
        sub = Subscription(channel)
        async with self._lock:
            subs = self._subs.setdefault(channel, set())
            is_first = not subs
            subs.add(sub)
            if is_first:
                self._live[channel] = asyncio.Event()
                self._confirms.setdefault(channel, deque()).append(self._live[channel])
                try:
                    await self._pubsub.subscribe(channel)
                except Exception:
                    subs.discard(sub)
                    self._live.pop(channel, None)
                    raise
                self._has_connection.set()
            live = self._live[channel]
        try:
            # A later waiter too: until Redis confirms, a final event published after its re-read could be lost.
            await asyncio.wait_for(live.wait(), SUBSCRIBE_TIMEOUT_S)
            if self._is_closed:
                sub.offer(CLOSED)
            yield sub
        finally:
            async with self._lock:
                subs = self._subs.get(channel, set())
                subs.discard(sub)
                if not subs:
                    self._subs.pop(channel, None)
                    self._live.pop(channel, None)
                    await self._pubsub.unsubscribe(channel)

    async def _run(self) -> None:
        await self._has_connection.wait()
        loop = asyncio.get_running_loop()
        ping_due = loop.time() + self._ping_interval_s
        pong_due: float | None = None
        """When the ping in flight must have been answered by; None: none in flight."""
        while True:
            try:
                message = await self._pubsub.get_message(timeout=min(1.0, self._ping_interval_s))
                now = loop.time()
                if pong_due is not None and now >= pong_due:
                    log.warning("event hub: Redis did not answer a ping on the pub/sub connection for %.0f s; "
                                "connecting again", self._pong_timeout_s)
                    self.num_reconnects += 1
                    pong_due, ping_due = None, now + self._ping_interval_s
                    if self._pubsub.connection is not None:
                        await self._pubsub.connection.disconnect()
                    continue
                if pong_due is None and now >= ping_due and self._subs:
                    await self._pubsub.ping()
                    pong_due, ping_due = now + self._pong_timeout_s, now + self._ping_interval_s
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                # redis-py reconnects and resubscribes on the next read; waiters re-read the record on heartbeats.
                self._outages.warn("event hub", e, "its pub/sub connection, which carries every waiter's events")
                pong_due = None
                raise_if_cancelled()
                await asyncio.sleep(RECONNECT_S)
                continue
            self._outages.recovered()
            raise_if_cancelled()
            if message is None:
                continue
            if message.get("type") == "pong":
                pong_due = None
            else:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        channel = message["channel"].decode() if isinstance(message.get("channel"), bytes) else str(message.get("channel"))
        if kind == "subscribe":
            pending = self._confirms.get(channel)
            if pending:
                pending.popleft().set()
                if not pending:
                    self._confirms.pop(channel, None)
            return
        if kind != "message":
            return
        try:
            event = msgpack.unpackb(message["data"], raw=False, strict_map_key=False)
        except Exception as e:  # a foreign publisher must not break everyone's streams
            log.warning("ignoring undecodable event on %s: %s", channel, e)
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            log.warning("ignoring malformed event on %s: %r", channel, event)
            return
        for sub in list(self._subs.get(channel, ())):
            sub.offer(event)


def is_terminal(record: dict[bytes, bytes]) -> bool:
    raw = record.get(F_STATUS.encode())
    return raw is not None and raw.decode() in {s.value for s in TERMINAL_STATUSES}


async def wait_for_terminal(
    redis: aioredis.Redis, hub: EventHub, keys: Keys, job_id: str, timeout_s: float,
    is_abandoned: Callable[[], bool] = lambda: False, check_s: float = 1.0,
) -> dict[bytes, bytes]:
    """The job record once it is terminal, or as it stands after `timeout_s` (empty if unknown); waiting ends
    early once `is_abandoned()` (looked at with every event, and every `check_s` without one: the client hung up)."""
    record = await read_hash(redis, keys.job(job_id))
    if not record or is_terminal(record) or timeout_s <= 0:
        return record
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with hub.subscribe(keys.events(job_id)) as sub:
        record = await read_hash(redis, keys.job(job_id))
        while record and not is_terminal(record):
            remaining = deadline - loop.time()
            # Looked at every event too: a running job sends one a step, so its waiter is never idle for long.
            if remaining <= 0 or is_abandoned():
                break
            try:
                event = await asyncio.wait_for(sub.queue.get(), min(remaining, check_s))
            except TimeoutError:
                continue
            if event["type"] == "closed":
                break
            if event["type"] == EventType.FINAL:
                record = await read_hash(redis, keys.job(job_id))
        if record and not is_terminal(record):
            # Once more before answering: a final event lost with a dropped connection still shows on the record.
            record = await read_hash(redis, keys.job(job_id))
    return record
