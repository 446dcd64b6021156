"""Reading the lane streams as one consumer of the ``carpool-workers`` group.

The pending-entries list (PEL) is the lease: an entry stays pending, owned by
this consumer, until its job's outcome is committed. Renewing a lease resets
the entry's idle time (``XCLAIM ... 0 ... JUSTID`` on our own entries, which
leaves the delivery count alone); another worker reclaims entries idle longer
than the lease with ``XAUTOCLAIM``, which counts a delivery.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import XReadGroupResponse

from scheduler.protocol import state_machine
from scheduler.protocol.keys import CONSUMER_GROUP, Keys
from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.redis_replies import stream_entries
from worker.job_store import EntryRef

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
        self._lane_of = {keys.lane(lane): lane for lane in LANES}
        self._renew = client.register_script(state_machine.RENEW_LEASE)
        self._hand_back = client.register_script(state_machine.HAND_BACK)

    async def ensure_groups(self) -> None:
        for lane in LANES:
            try:
                await self.client.xgroup_create(self.keys.lane(lane), CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    async def read(self, free: int) -> list[Entry]:
        """At most `free` new entries: the slots are shared by weight, interactive read first,
        and a lane that comes up short passes its slots on. Blocks briefly when all are empty.

        The weighted reads share one round trip; a lane that returned less than its share is empty
        and is not asked again."""
        if free <= 0:
            return []
        shares = self.shares.split(free)
        asked = [lane for lane in LANES if shares[lane]]
        pipe = self.client.pipeline(transaction=False)
        for lane in asked:
            pipe.xreadgroup(CONSUMER_GROUP, self.name, {self.keys.lane(lane): ">"}, count=shares[lane])
        got: list[Entry] = []
        empty: set[Lane] = set()
        for lane, reply in zip(asked, await pipe.execute()):
            entries = self._entries(reply)
            if len(entries) < shares[lane]:
                empty.add(lane)
            got += entries
        for lane in LANES:
            if len(got) < free and lane not in empty:
                got += await self._read_lane(lane, free - len(got))
        if got:
            return got
        # Idle: block on every lane at once; the reply carries only the stream that woke us,
        # so a share per lane keeps a simultaneous wake-up within `free`.
        count = max(1, free // len(LANES))
        reply = await self.client.xreadgroup(
            CONSUMER_GROUP, self.name, {s: ">" for s in self.keys.lanes()}, count=count, block=self.read_block_ms
        )
        return self._entries(reply)

    async def read_interactive(self, count: int) -> list[Entry]:
        """At most `count` new interactive entries, without waiting (the reserve beyond the free slots)."""
        return await self._read_lane(Lane.INTERACTIVE, count)

    async def _read_lane(self, lane: Lane, count: int) -> list[Entry]:
        reply = await self.client.xreadgroup(CONSUMER_GROUP, self.name, {self.keys.lane(lane): ">"}, count=count)
        return self._entries(reply)

    def _entries(self, reply: XReadGroupResponse) -> list[Entry]:
        out: list[Entry] = []
        for stream, messages in stream_entries(reply):
            name = stream.decode()
            for entry_id, fields in messages:
                out.append(Entry(EntryRef(name, entry_id.decode()), self._lane_of[name], fields or None, 1))
        return out

    async def reclaim(self, free: int) -> list[Entry]:
        """Take over up to `free` entries whose owner stopped renewing them for longer than the lease."""
        out: list[Entry] = []
        for lane in LANES:
            if len(out) >= free:
                break
            stream = self.keys.lane(lane)
            reply = await self.client.xautoclaim(stream, CONSUMER_GROUP, self.name, self.lease_ms,
                                                 start_id="0-0", count=free - len(out))
            messages = reply[1]
            if not messages:
                continue
            pipe = self.client.pipeline(transaction=False)
            ids = []
            for entry_id, _fields in messages:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                ids.append(eid)
                pipe.xpending_range(stream, CONSUMER_GROUP, min=eid, max=eid, count=1)
            pending = await pipe.execute()
            for (entry_id, fields), eid, info in zip(messages, ids, pending):
                deliveries = int(info[0]["times_delivered"]) if info else 1
                out.append(Entry(EntryRef(stream, eid), lane, fields or None, deliveries))
        if out:
            log.info("reclaimed %d entries whose worker stopped renewing them", len(out))
        return out

    async def renew(self, refs: Iterable[EntryRef]) -> set[EntryRef]:
        """Reset the idle time of our entries; returns those no longer ours (reclaimed elsewhere or acked)."""
        by_stream: dict[str, list[EntryRef]] = {}
        for ref in refs:
            by_stream.setdefault(ref.stream, []).append(ref)
        lost: set[EntryRef] = set()
        for stream, wanted in by_stream.items():
            gone = await self._renew(keys=[stream], args=[CONSUMER_GROUP, self.name, *(r.entry_id for r in wanted)])
            lost |= {EntryRef(stream, eid.decode() if isinstance(eid, bytes) else eid) for eid in gone}
        return lost

    async def hand_back(self, jobs: dict[EntryRef, str]) -> None:
        """Make our entries look long idle so the next worker's XAUTOCLAIM takes them at once, and count a
        clean hand-back on each job's record. ``jobs``: entry -> job id."""
        by_stream: dict[str, list[str]] = {}
        for ref, job_id in jobs.items():
            by_stream.setdefault(ref.stream, []).extend([ref.entry_id, self.keys.job(job_id)])
        for stream, pairs in by_stream.items():
            await self._hand_back(keys=[stream], args=[CONSUMER_GROUP, self.name, HANDBACK_IDLE_MS, *pairs])
