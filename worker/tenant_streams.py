"""The streams a worker reads in each lane: the lane stream (the default tenant's) and one per active tenant.

Before each read the worker routes what direct producers XADDed to a lane stream for a named tenant into
that tenant's stream, then learns each lane's active tenants and their weights. `plan` shares a lane's
slots out over its tenants by weight (smooth weighted round-robin, state kept per lane); a tenant whose
stream came up short is retired from the active set once its stream is empty.

A producer may also XADD straight into a tenant's stream (its name is documented) without marking the tenant
active: nobody would read it. `adopt_strays` walks the key space a slice at a time for tenant streams that hold
entries while their tenant is out of the active set, and puts it back in; the fleet shares one walk (a cursor in
Redis), one worker a sweep interval taking the next slice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from scheduler.protocol import state_machine
from scheduler.protocol.keys import CONSUMER_GROUP, ROUTE_SCAN_COUNT, WAKE_MAXLEN, Keys
from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.redis_client import ensure_group, is_wrong_type
from scheduler.protocol.tenants import DEFAULT_TENANT, DEFAULT_WEIGHT, MAX_WEIGHT, TenantShares, named_tenants

log = logging.getLogger(__name__)

STRAY_SCAN_COUNT = 1_000
"""Keys each SCAN call of `adopt_strays` looks at."""
STRAY_SCAN_CALLS = 10
"""SCAN calls per slice: the fleet walks a million keys in a hundred sweep intervals (12.5 minutes at the default
lease of 30 s, a sweep every quarter lease)."""


@dataclass(frozen=True)
class Source:
    """One stream a lane's jobs wait in, and whose they are."""

    lane: Lane
    tenant: str
    stream: str


class TenantStreams:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._shares = {lane: TenantShares() for lane in LANES}
        self._weights: dict[str, int] = {}
        self._lane_of = {keys.lane(lane): lane for lane in LANES}
        """Stream -> lane of every stream seen; grows by one per tenant stream."""
        self.wrong_type: dict[str, str] = {}
        """Keys this worker reads (streams, and the sets, cursors and hash routing keeps) that hold another Redis
        type than theirs (a list a producer RPUSHed to a lane's name, say), with that type: left out until the key
        is of its type again or gone (`check_types`)."""
        self._route = client.register_script(state_machine.ROUTE_TO_TENANTS)
        self._deactivate = client.register_script(state_machine.RETIRE_TENANTS)
        self._stray_turn = client.register_script(state_machine.STRAY_SCAN_TURN)

    def lane_of(self, stream: str) -> Lane | None:
        return self._lane_of.get(stream)

    async def sources(self, *, route: bool = True) -> dict[Lane, list[Source]]:
        """Each lane's streams, the lane stream first (streams of the wrong type left out). One round trip;
        routes first unless told not to."""
        if self.wrong_type:
            types = self._types()  # a tenant's stream is none of these: a stream
            await self.check_types({key: types.get(key, "stream") for key in self.wrong_type})
        routed = [lane for lane in LANES if route and not any(key in self.wrong_type for key in self._route_keys(lane))]
        async with self.client.pipeline(transaction=False) as pipe:
            for lane in routed:
                await self._route(
                    keys=self._route_keys(lane),
                    args=[CONSUMER_GROUP, ROUTE_SCAN_COUNT, self.keys.tenant_lane_prefix(lane), WAKE_MAXLEN],
                    client=pipe)
            for lane in LANES:
                pipe.smembers(self.keys.lane_tenants(lane))
            pipe.hgetall(self.keys.tenant_weights)
            replies = await pipe.execute(raise_on_error=False)
        failed = [r for r in replies if isinstance(r, Exception)]
        for reply in failed:
            if not is_wrong_type(reply):
                raise reply
        if failed:  # a key of routing's is another type: found, said, left out
            await self.check_types(self._types())
        blocked = [s.decode(errors="replace") for r in replies[:len(routed)] if isinstance(r, list) for s in r[1:]]
        if blocked:  # a tenant's stream is another type: its jobs stay in the lane, served from there
            await self.check_types([s for s in blocked if s not in self.wrong_type])
        replies = replies[len(routed):]
        self._weights = {} if isinstance(replies[-1], Exception) else _weights(replies[-1])
        out: dict[Lane, list[Source]] = {}
        for lane, members in zip(LANES, replies[:-1]):
            streams = [Source(lane, DEFAULT_TENANT, self.keys.lane(lane))]
            if not isinstance(members, Exception):  # the active set is another type: its tenants wait
                streams += [Source(lane, t, self.keys.tenant_lane(lane, t)) for t in named_tenants(members)]
            for source in streams:
                self._lane_of[source.stream] = lane
            self._shares[lane].keep({s.tenant for s in streams})
            out[lane] = [s for s in streams if s.stream not in self.wrong_type]
        return out

    def _route_keys(self, lane: Lane) -> list[str]:
        return [self.keys.lane(lane), self.keys.lane_route_cursor(lane), self.keys.lane_tenants(lane), self.keys.wake]

    def _types(self) -> dict[str, str]:
        """The Redis type of every key routing and reading keep, bar the tenants' streams."""
        types = {self.keys.wake: "stream", self.keys.tenant_weights: "hash"}
        for lane in LANES:
            types |= {self.keys.lane(lane): "stream", self.keys.lane_route_cursor(lane): "string",
                      self.keys.lane_tenants(lane): "set"}
        return types

    async def check_types(self, expected: dict[str, str] | list[str]) -> None:
        """Learn which of these keys (key -> its type; a list: streams) hold another Redis type: each newly found
        is said once, as an error naming the key, and left out; one of its type again, or gone (a stream made
        again, empty, with its group), is used again."""
        wanted = dict.fromkeys(expected, "stream") if isinstance(expected, list) else expected
        async with self.client.pipeline(transaction=False) as pipe:
            for key in wanted:
                pipe.type(key)
            kinds = await pipe.execute()
        for (key, want), kind in zip(wanted.items(), kinds):
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind in (want, "none"):
                if self.wrong_type.pop(key, None) is not None:
                    if want == "stream":
                        await ensure_group(self.client, key, CONSUMER_GROUP)
                    log.warning("key %s is a Redis %s again (or gone): using it", key, want)
            elif key not in self.wrong_type:
                self.wrong_type[key] = kind
                what = ("what it keeps for the tenants' streams is not read or written (jobs in the lane streams "
                        "still are)" if want != "stream" else
                        "no job is read from it (other streams are)" if key in self.keys.lanes() else
                        "its tenant's jobs stay in the lane stream and are served from there, outside the "
                        "tenants' fair share,")
                log.error("key %s holds a Redis %s, not the %s carpool keeps there: %s until it is deleted or "
                          "of its type again", key, kind, want, what, extra={"key": key, "redis_type": kind})

    def plan(self, lane: Lane, slots: int, sources: list[Source]) -> list[tuple[Source, int]]:
        """`slots` of `lane` shared over `sources` by their tenants' weights; only sources given a slot."""
        by_tenant = {s.tenant: s for s in sources}
        split = self._shares[lane].split(slots, {t: self._weights.get(t, DEFAULT_WEIGHT) for t in by_tenant})
        return [(by_tenant[t], n) for t, n in split.items() if n]

    async def retire_empty(self, sources: list[Source]) -> None:
        """Take tenants whose stream came up short out of their lane's active set, if their stream is empty."""
        by_lane: dict[Lane, list[Source]] = {}
        for s in sources:
            if s.tenant != DEFAULT_TENANT:
                by_lane.setdefault(s.lane, []).append(s)
        for lane, named in by_lane.items():
            await self._deactivate(keys=[self.keys.lane_tenants(lane), *(s.stream for s in named)],
                                   args=[s.tenant for s in named])

    async def adopt_strays(self, worker: str, interval_ms: int) -> list[Source]:
        """When it is this worker's turn (none took one within `interval_ms`): the next slice of the fleet's walk
        of the key space for tenant streams holding entries whose tenant is out of its lane's active set (a
        producer XADDed into the stream itself). Each gets its consumer group where it has none, and its tenant
        goes back into the active set, with a wake for idle workers. Returns those."""
        cursor = await self._stray_turn(keys=[self.keys.stray_scan, self.keys.stray_scan_turn], args=[worker, interval_ms])
        if cursor is None:
            return []
        prefixes = {self.keys.tenant_lane_prefix(lane): lane for lane in LANES}
        found: list[Source] = []
        next_cursor = int(cursor)
        for _ in range(STRAY_SCAN_CALLS):
            next_cursor, names = await self.client.scan(next_cursor, match=self.keys.tenant_lanes_glob(),
                                                        count=STRAY_SCAN_COUNT, _type="stream")
            for raw in names:
                name = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                for prefix, lane in prefixes.items():
                    if name.startswith(prefix) and named_tenants([name[len(prefix):]]):
                        found.append(Source(lane, name[len(prefix):], name))
            if next_cursor == 0:
                break
        await self.client.set(self.keys.stray_scan, next_cursor)
        if not found:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for source in found:
                pipe.sismember(self.keys.lane_tenants(source.lane), source.tenant)
                pipe.xlen(source.stream)
            replies = await pipe.execute()
        strays = [s for s, is_member, length in zip(found, replies[::2], replies[1::2]) if not is_member and length]
        for source in strays:
            # A stream deleted meanwhile comes back empty: its tenant retires as any empty one does.
            await ensure_group(self.client, source.stream, CONSUMER_GROUP)
            await self.client.sadd(self.keys.lane_tenants(source.lane), source.tenant)
            await self.client.xadd(self.keys.wake, {"tenant": source.tenant}, maxlen=WAKE_MAXLEN, approximate=True)
            log.info("%s held entries while tenant %r was not active in lane %s (XADDed into the tenant's stream "
                     "directly); it is read again", source.stream, source.tenant, source.lane.value)
        return strays


def _weights(raw: dict[bytes, bytes]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, v in raw.items():
        try:
            weight = int(v)
        except ValueError:
            continue  # a weight written by hand that is no number counts as the default
        out[k.decode()] = min(max(weight, 1), MAX_WEIGHT)
    return out
