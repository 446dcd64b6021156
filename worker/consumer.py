"""Reading the lane streams, and the tenants' streams inside each lane, as one consumer of ``carpool-workers``.

The pending-entries list (PEL) is the lease: an entry stays pending, owned by
this consumer, until its job's outcome is committed. Renewing a lease resets
the entry's idle time (``XCLAIM ... 0 ... JUSTID`` on our own entries, which
leaves the delivery count alone); another worker reclaims entries idle longer
than the lease with ``XAUTOCLAIM``, which counts a delivery.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import XReadGroupResponse

from scheduler.protocol import state_machine
from scheduler.protocol.keys import CONSUMER_GROUP, Keys
from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.redis_client import ensure_group, is_wrong_type
from scheduler.protocol.redis_replies import stream_entries
from worker.job_store import EntryRef
from worker.tenant_streams import Source, TenantStreams

log = logging.getLogger(__name__)


HANDBACK_IDLE_MS = 365 * 24 * 3600 * 1000
"""Idle time given to handed-back entries, past any worker's lease, so the next XAUTOCLAIM takes them."""


@dataclass
class Entry:
    ref: EntryRef
    lane: Lane
    fields: dict[bytes, bytes] | None
    """None when the entry was deleted or trimmed while pending."""
    deliveries: int


class LaneShares:
    """Smooth weighted round-robin over lanes: deterministic, and every lane with weight > 0 gets its turn."""

    def __init__(self, weights: dict[Lane, int]) -> None:
        self.weights = dict(weights)
        self._current = {lane: 0 for lane in weights}

    def pick(self) -> Lane:
        total = sum(self.weights.values())
        for lane, weight in self.weights.items():
            self._current[lane] += weight
        best = max(self.weights, key=lambda lane: (self._current[lane], -LANES.index(lane)))
        self._current[best] -= total
        return best

    def split(self, slots: int) -> dict[Lane, int]:
        shares = {lane: 0 for lane in self.weights}
        for _ in range(slots):
            shares[self.pick()] += 1
        return shares


class LaneConsumer:
    def __init__(self, client: aioredis.Redis, keys: Keys, name: str, weights: dict[Lane, int], *,
                 lease_ms: int, read_block_ms: int, max_deliveries: int) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.shares = LaneShares(weights)
        self.lease_ms = lease_ms
        self.read_block_ms = read_block_ms
        self.max_deliveries = max_deliveries
        self.tenants = TenantStreams(client, keys)
        self._renew = client.register_script(state_machine.RENEW_LEASE)
        self._hand_back = client.register_script(state_machine.HAND_BACK)

    async def ensure_groups(self) -> None:
        for stream in [*self.keys.lanes(), self.keys.wake]:
            await self._give_group(stream)

    async def read(self, free: int) -> list[Entry]:
        """At most `free` new entries: the slots are shared over the lanes by weight, and inside a lane over
        its active tenants by weight; a lane or tenant that comes up short passes its slots on (the most
        urgent lane with work left first, shared over its tenants again). Blocks briefly when all are empty.

        Each round of reads shares one round trip; a stream that returned less than asked is empty and is
        not asked again."""
        if free <= 0:
            return []
        sources = await self.tenants.sources()
        got, empty = await self._read_round(
            [pair for lane, n in self.shares.split(free).items() if n
             for pair in self.tenants.plan(lane, n, sources[lane])])
        for lane in LANES:
            while len(got) < free:
                left = [s for s in sources[lane] if s.stream not in {e.stream for e in empty}]
                if not left:
                    break
                more, more_empty = await self._read_round(self.tenants.plan(lane, free - len(got), left))
                got += more
                empty += more_empty
        await self.tenants.retire_empty(empty)
        if got:
            return got
        # Idle: block on every stream at once, and on the wake stream that a newly active tenant rings;
        # the reply carries only the stream that woke us, so a share per stream keeps a wake-up within `free`.
        streams = [s.stream for lane in LANES for s in sources[lane]]
        wake = [] if self.keys.wake in self.tenants.wrong_type else [self.keys.wake]
        if not streams and not wake:  # every stream is another type: nothing to block on, so wait as long
            await asyncio.sleep(self.read_block_ms / 1000)
            return []
        try:
            reply = await self.client.xreadgroup(
                CONSUMER_GROUP, self.name, {s: ">" for s in [*streams, *wake]},
                count=max(1, free // (len(streams) + len(wake))), block=self.read_block_ms,
            )
        except ResponseError as e:
            if is_wrong_type(e):
                await self.tenants.check_types([*streams, self.keys.wake])
                # A read that fails at once is no blocking read: wait as long as one, not to spin on Redis.
                await asyncio.sleep(self.read_block_ms / 1000)
                return []
            # NOGROUP: a group deleted; UNBLOCKED (Redis 7): a stream deleted while the read waited on it.
            if "NOGROUP" not in str(e) and not str(e).startswith("UNBLOCKED"):
                raise
            await self._repair([*streams, self.keys.wake])
            return []
        return await self._without_wake(self._entries(reply))

    async def _repair(self, streams: list[str]) -> None:
        """Give back its consumer group to a stream that lost it (deleted from outside); an empty new stream
        for one that is gone (its tenant then retires as any empty one does); one made another type meanwhile is
        said and left out (`TenantStreams.check_types`)."""
        for stream in streams:
            if await self._give_group(stream):
                log.warning("stream %s had no consumer group %s (deleted from outside, or lost with Redis's data: a "
                            "Redis restarted without persistence, or failed over to a replica behind it); made it "
                            "again", stream, CONSUMER_GROUP)

    async def _give_group(self, stream: str) -> bool:
        """`ensure_group`: True when the group was made; False when it was there, or when the key is another type
        (which `TenantStreams.check_types` says, and leaves out)."""
        try:
            return await ensure_group(self.client, stream, CONSUMER_GROUP)
        except ResponseError as e:
            if not is_wrong_type(e):
                raise
            await self.tenants.check_types([stream])
            return False

    async def read_interactive(self, count: int) -> list[Entry]:
        """At most `count` new interactive entries, without waiting (the reserve beyond the free slots)."""
        sources = (await self.tenants.sources(route=False))[Lane.INTERACTIVE]
        got, empty = await self._read_round(self.tenants.plan(Lane.INTERACTIVE, count, sources))
        while len(got) < count:
            left = [s for s in sources if s.stream not in {e.stream for e in empty}]
            if not left:
                break
            more, more_empty = await self._read_round(self.tenants.plan(Lane.INTERACTIVE, count - len(got), left))
            got += more
            empty += more_empty
        return got

    async def _read_round(self, plan: list[tuple[Source, int]]) -> tuple[list[Entry], list[Source]]:
        """One pipelined read per (stream, count): the entries, and the sources that came up short."""
        if not plan:
            return [], []
        async with self.client.pipeline(transaction=False) as pipe:
            for source, n in plan:
                pipe.xreadgroup(CONSUMER_GROUP, self.name, {source.stream: ">"}, count=n)
            replies = await pipe.execute(raise_on_error=False)
        got: list[Entry] = []
        empty: list[Source] = []
        for (source, n), reply in zip(plan, replies):
            if isinstance(reply, ResponseError) and "NOGROUP" in str(reply):
                await self._repair([source.stream])
                empty.append(source)
                continue
            if is_wrong_type(reply):  # made another type since the sources were learnt
                await self.tenants.check_types([source.stream])
                empty.append(source)
                continue
            if isinstance(reply, Exception):
                raise reply
            entries = self._entries(reply)
            if len(entries) < n:
                empty.append(source)
            got += entries
        return got, empty

    async def _without_wake(self, entries: list[Entry]) -> list[Entry]:
        """Drop (acknowledge and delete) wake-stream entries: they only ended the blocking read."""
        wake = [e.ref.entry_id for e in entries if e.ref.stream == self.keys.wake]
        if wake:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.xack(self.keys.wake, CONSUMER_GROUP, *wake)
                pipe.xdel(self.keys.wake, *wake)
                await pipe.execute()
        return [e for e in entries if e.ref.stream != self.keys.wake]

    def _entries(self, reply: XReadGroupResponse) -> list[Entry]:
        out: list[Entry] = []
        for stream, messages in stream_entries(reply):
            name = stream.decode()
            lane = self.tenants.lane_of(name) or Lane.STANDARD  # only the wake stream is no lane's
            for entry_id, fields in messages:
                out.append(Entry(EntryRef(name, entry_id.decode()), lane, fields or None, 1))
        return out

    async def reclaim(self, free: int, *, handed_back_only: bool = False) -> list[Entry]:
        """Take over up to `free` entries whose owner stopped renewing them for longer than the lease,
        from every stream of every lane (the tenants' streams stay active while they hold entries).

        `handed_back_only`: only entries handed back (made to look idle for `HANDBACK_IDLE_MS`), not those
        merely idle past the lease: right after a Redis outage every lease has lapsed, live workers' too."""
        min_idle_ms = HANDBACK_IDLE_MS // 2 if handed_back_only else self.lease_ms
        out: list[Entry] = []
        sources = await self.tenants.sources(route=False)
        for source in [s for lane in LANES for s in sources[lane]]:
            if len(out) >= free:
                break
            stream = source.stream
            try:
                # The idle entries, found wherever they are in the stream's pending list (XAUTOCLAIM from its start
                # looks at ten entries per one it may take, and finds none behind a run of others that are renewed);
                # each then claimed by its id, only if it is idle still (another worker may have taken it).
                idle = await self.client.xpending_range(stream, CONSUMER_GROUP, min="-", max="+",
                                                        count=free - len(out), idle=min_idle_ms)
                if not idle:
                    continue
                async with self.client.pipeline(transaction=False) as pipe:
                    for found in idle:
                        pipe.xclaim(stream, CONSUMER_GROUP, self.name, min_idle_ms, [found["message_id"]])
                    replies = await pipe.execute()
            except ResponseError as e:
                if is_wrong_type(e):
                    await self.tenants.check_types([stream])
                    continue
                if "NOGROUP" not in str(e):
                    raise
                await self._repair([stream])
                continue
            # One claimed entry per reply, or none (taken meanwhile); one deleted while pending comes back from
            # Redis 6.2 as a null entry (7 drops it from the list instead), and is taken only to be acknowledged.
            messages = [(_text(found["message_id"]), fields) for found, reply in zip(idle, replies)
                        for _entry_id, fields in reply]
            if not messages:
                continue
            async with self.client.pipeline(transaction=False) as pipe:
                for eid, _fields in messages:
                    pipe.xpending_range(stream, CONSUMER_GROUP, min=eid, max=eid, count=1)
                pending = await pipe.execute()
            for (eid, fields), info in zip(messages, pending):
                deliveries = int(info[0]["times_delivered"]) if info else 1
                out.append(Entry(EntryRef(stream, eid), source.lane, fields or None, deliveries))
        if out:
            log.info("reclaimed %d entries whose worker stopped renewing them", len(out))
        return out

    async def own_pending(self, free: int, known: set[EntryRef]) -> list[Entry]:
        """Up to `free` entries pending for this very consumer that it does not hold (`known`): Redis delivered
        them to a read whose reply never came back (a timeout, a dropped connection, the process paused past
        its socket timeout), or to an earlier process of this worker's name. Taken now, not a lease later."""
        out: list[Entry] = []
        sources = await self.tenants.sources(route=False)
        for source in [s for lane in LANES for s in sources[lane]]:
            if len(out) >= free:
                break
            try:
                pending = await self.client.xpending_range(source.stream, CONSUMER_GROUP, min="-", max="+",
                                                           count=free + len(known), consumername=self.name)
            except ResponseError as e:
                if is_wrong_type(e):
                    await self.tenants.check_types([source.stream])
                elif "NOGROUP" not in str(e):
                    raise
                continue
            found = [(_text(p["message_id"]), int(p["times_delivered"])) for p in pending]
            found = [(eid, n) for eid, n in found if EntryRef(source.stream, eid) not in known][:free - len(out)]
            if not found:
                continue
            async with self.client.pipeline(transaction=False) as pipe:
                for eid, _ in found:
                    pipe.xrange(source.stream, min=eid, max=eid, count=1)
                replies = await pipe.execute()
            for (eid, deliveries), rows in zip(found, replies):
                fields = rows[0][1] if rows else None  # deleted while pending: admitted only to be acknowledged
                out.append(Entry(EntryRef(source.stream, eid), source.lane, fields or None, deliveries))
        if out:
            log.info("took back %d entries delivered to this worker whose read never returned", len(out))
        return out

    async def renew(self, refs: Iterable[EntryRef]) -> set[EntryRef]:
        """Reset the idle time of our entries; returns those no longer ours (reclaimed elsewhere or acked)."""
        by_stream: dict[str, list[EntryRef]] = {}
        for ref in refs:
            by_stream.setdefault(ref.stream, []).append(ref)
        lost: set[EntryRef] = set()
        for stream, wanted in by_stream.items():
            try:
                gone = await self._renew(keys=[stream],
                                         args=[CONSUMER_GROUP, self.name, *(r.entry_id for r in wanted)])
            except ResponseError as e:
                if not is_wrong_type(e):
                    raise
                # The stream was replaced by a key of another type: nothing of it is left to renew (or take).
                await self.tenants.check_types([stream])
                continue
            lost |= {EntryRef(stream, eid.decode() if isinstance(eid, bytes) else eid) for eid in gone}
        return lost

    async def hand_back(self, jobs: dict[EntryRef, str], is_clean: bool = True) -> None:
        """Make our entries look long idle so the next worker's XAUTOCLAIM takes them at once, and, for a clean
        stop, count a clean hand-back on each job's record (not counted against max_deliveries). ``jobs``:
        entry -> job id."""
        by_stream: dict[str, list[str]] = {}
        for ref, job_id in jobs.items():
            by_stream.setdefault(ref.stream, []).extend([ref.entry_id, self.keys.job(job_id)])
        for stream, pairs in by_stream.items():
            try:
                await self._hand_back(keys=[stream], args=[CONSUMER_GROUP, self.name, HANDBACK_IDLE_MS,
                                                           "1" if is_clean else "", *pairs])
            except ResponseError as e:
                if not is_wrong_type(e):
                    raise
                # Replaced by a key of another type: no entry of it is left to hand back; the other streams' are.
                await self.tenants.check_types([stream])


def _text(reply: object) -> str:
    """A reply field as text (redis-py hands back bytes)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)
