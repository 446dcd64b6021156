"""Fair share inside a lane, as the consumer reads it from a real Redis: tenants' streams, routing, retiring."""

from __future__ import annotations

import asyncio
import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.protocol.lanes import Lane
from scheduler.protocol.tenants import DEFAULT_TENANT, TenantLabels, TenantLimits, TenantShares, parse_limits, tenant_of
from tests.harness.worker_harness import KEYS
from worker.consumer import LaneConsumer

BATCH_ONLY = {Lane.INTERACTIVE: 0, Lane.STANDARD: 0, Lane.BATCH: 1}


def test_tenant_shares_follow_weights_interleave_and_take_newcomers_level() -> None:
    shares = TenantShares()
    picks = [t for _ in range(30) for t, n in shares.split(1, {"a": 2, "b": 1}).items() if n]
    assert picks.count("a") == 20 and picks.count("b") == 10
    assert all(picks[i:i + 3].count("b") == 1 for i in range(0, 30, 3))  # smooth: b every third pick
    # A tenant that arrives later is served at once, not after the others' past turns.
    assert shares.split(3, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}


def test_limits_parse_and_refuse_nonsense() -> None:
    assert parse_limits("rpm=60, tpm=40000,max_queued=5,weight=3") == TenantLimits(
        max_queued=5, requests_per_minute=60, tokens_per_minute=40000, weight=3)
    assert parse_limits("") == TenantLimits()
    for bad in ("rpm", "rpm=x", "speed=3", "rpm=0", "weight=0", "weight=1001", "rpm=5,rpm=7", "rpm=5,requests_per_minute=5",
                "rpm=1_000", "rpm=+5", "rpm=\u0663", "tpm=1000000000001", "tpm=99999999999999999999999999",
                "rpm=" + "9" * 5000):
        with pytest.raises(ValueError):
            parse_limits(bad)
    assert parse_limits("tpm=1000000000000, rpm= 5") == TenantLimits(tokens_per_minute=10**12, requests_per_minute=5)
    assert parse_limits("rpm=" + "0" * 5000 + "7") == TenantLimits(requests_per_minute=7)
    assert TenantLimits.from_fields(parse_limits("tpm=7,weight=2").to_fields()) == parse_limits("tpm=7,weight=2")
    # A key stored before limits had a maximum keeps working, at the maximum.
    assert TenantLimits.from_fields({"tokens_per_minute": "9" * 26}).tokens_per_minute == 10**12


def test_tenant_names_and_the_label_cap() -> None:
    assert tenant_of("acme-1.eu_x") == "acme-1.eu_x"
    for bad in (None, "", "-lead", "a b", "x" * 65, 7, "é"):
        assert tenant_of(bad) == DEFAULT_TENANT
    labels = TenantLabels(2)
    assert [labels.label(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "_other", "a", "_other", "b"]


async def _enqueue(client: aioredis.Redis, tenant: str, n: int, lane: Lane = Lane.BATCH) -> None:
    """As the gateway does: the entry in the tenant's stream and the tenant in the lane's active set."""
    stream = KEYS.tenant_lane(lane, tenant)
    if not await client.exists(stream):
        await client.xgroup_create(stream, "carpool-workers", id="0", mkstream=True)
    for i in range(n):
        await client.xadd(stream, {"job": f"{tenant}-{i}".encode()})
    await client.sadd(KEYS.lane_tenants(lane), tenant)


def _names(entries: list) -> list[str]:
    return [e.fields[b"job"].decode() for e in entries]


async def test_reads_of_one_slot_alternate_between_active_tenants_and_pass_empty_turns_on(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    await _enqueue(client, "a", 100)
    first = [_names(await consumer.read(1))[0] for _ in range(5)]
    assert first == [f"a-{i}" for i in range(5)]  # alone in the lane (the empty lane stream passes its turns on)
    await _enqueue(client, "b", 4)
    got = [_names(await consumer.read(1))[0] for _ in range(10)]
    # b's four jobs are served within its first eight reads, interleaved with a's, though a has 95 waiting.
    assert [g for g in got if g.startswith("b")] == ["b-0", "b-1", "b-2", "b-3"]
    assert max(i for i, g in enumerate(got) if g.startswith("b")) <= 7
    assert [g for g in got if g.startswith("a")] == [f"a-{i}" for i in range(5, 11)]
    # A read of many slots shares them the same way, never more than asked, nothing twice.
    await _enqueue(client, "b", 10)
    many = _names(await consumer.read(10))
    assert len(many) == 10 and 4 <= sum(n.startswith("b") for n in many) <= 6
    await client.aclose()


async def test_weights_share_a_lane_in_proportion(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    await client.hset(KEYS.tenant_weights, mapping={"heavy": 3})
    await _enqueue(client, "heavy", 50)
    await _enqueue(client, "light", 50)
    got = [n for _ in range(40) for n in _names(await consumer.read(1))]
    assert sum(n.startswith("heavy") for n in got) == 30 and sum(n.startswith("light") for n in got) == 10
    await client.aclose()


async def test_direct_xadds_naming_a_tenant_are_routed_to_its_stream_and_the_rest_stay(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    lane = KEYS.lane(Lane.BATCH)
    for i in range(30):
        await client.xadd(lane, {"job": msgpack.packb({"id": f"flood-{i}", "tenant": "flood", "prompt": "x"})})
    await client.xadd(lane, {"job": b'{"id": "json-1", "tenant": "polite", "prompt": "x"}'})
    await client.xadd(lane, {"job": msgpack.packb({"id": "plain-1", "prompt": "x"})})
    await client.xadd(lane, {"job": msgpack.packb({"id": "odd-1", "tenant": "no spaces allowed", "prompt": "x"})})
    await client.xadd(lane, {"job": b"not a job at all"})
    got = await consumer.read(4)
    ids = [msgpack.unpackb(e.fields[b"job"])["id"] if e.fields[b"job"][:1] != b"{" else "json-1"
           for e in got if e.fields[b"job"] != b"not a job at all"]
    # Three sources share the four slots: the lane stream (default tenant: plain, odd, garbage), flood, polite.
    assert "json-1" in ids and "flood-0" in ids and "plain-1" in ids
    assert set(await client.smembers(KEYS.lane_tenants(Lane.BATCH))) == {b"flood", b"polite"}
    assert await client.xlen(KEYS.tenant_lane(Lane.BATCH, "flood")) == 30  # routed, none lost
    routed = (await client.xrange(KEYS.tenant_lane(Lane.BATCH, "flood"), count=1))[0][1]
    assert routed[b"routed_from"].split(b"-")[0].isdigit()  # the first XADD's time stays with the entry
    # Everything is read exactly once in the end.
    rest = []
    while batch := await consumer.read(50):
        rest += batch
    assert len(got) + len(rest) == 34
    await client.aclose()


async def test_an_empty_tenant_leaves_the_active_set_only_when_nothing_of_it_is_pending(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    await _enqueue(client, "solo", 1)
    (entry,) = await consumer.read(5)
    assert await client.smembers(KEYS.lane_tenants(Lane.BATCH)) == {b"solo"}  # still pending: stays for reclaim
    await client.xack(entry.ref.stream, "carpool-workers", entry.ref.entry_id)
    await client.xdel(entry.ref.stream, entry.ref.entry_id)
    assert await consumer.read(5) == []
    assert await client.smembers(KEYS.lane_tenants(Lane.BATCH)) == set()
    await client.aclose()


async def test_a_blocked_reader_wakes_for_a_tenant_that_becomes_active(redis_url: str) -> None:
    import asyncio

    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=60_000,
                            max_deliveries=5)
    await consumer.ensure_groups()
    reading = asyncio.create_task(consumer.read(1))
    await asyncio.sleep(0)  # let it reach its blocking read (it blocks a minute unless woken)
    while not any(c.get("cmd") == "xreadgroup" for c in await client.client_list()):
        await asyncio.sleep(0.005)
    await _enqueue(client, "late", 1)
    await client.xadd(KEYS.wake, {"tenant": "late"})  # what the gateway's enqueue adds for a newly active tenant
    assert await asyncio.wait_for(reading, 30) == []  # woken; the wake entry itself is no job
    assert _names(await consumer.read(1)) == ["late-0"]
    assert await client.xlen(KEYS.wake) == 0
    await client.aclose()


async def test_a_tenant_stream_deleted_from_outside_does_not_stop_the_reader(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    await _enqueue(client, "gone", 2)
    await _enqueue(client, "kept", 2)
    await client.delete(KEYS.tenant_lane(Lane.BATCH, "gone"))
    got = [n for _ in range(4) for n in _names(await consumer.read(1))]
    assert got == ["kept-0", "kept-1"]
    assert await consumer.reclaim(5) == []
    assert await client.smembers(KEYS.lane_tenants(Lane.BATCH)) == {b"kept"}  # the emptied one retired
    await client.aclose()


async def test_lane_depth_gauges_count_the_tenants_streams(redis_url: str) -> None:
    from scheduler.telemetry.stream_stats import StreamStats

    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    await _enqueue(client, "a", 3)
    await _enqueue(client, "b", 2)
    await client.xadd(KEYS.lane(Lane.BATCH), {"job": b"plain"})
    await consumer.read(2)
    snapshot = await StreamStats(client, KEYS).refresh()
    assert snapshot.depth[Lane.BATCH] == 6 and snapshot.pending[Lane.BATCH] == 2
    await client.aclose()


@pytest.mark.parametrize("lead", [b"\n", b"  \t", b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n"])
async def test_a_json_job_after_whitespace_or_a_byte_order_mark_is_routed_to_its_tenant(redis_url: str,
                                                                                          lead: bytes) -> None:
    """The routing script reads such a job as the worker does (JSON), so its tenant's share applies."""
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    await client.xadd(KEYS.lane(Lane.BATCH), {"job": lead + b'{"id": "j", "tenant": "polite", "prompt": "x"}'})
    (entry,) = await consumer.read(4)
    assert entry.ref.stream == KEYS.tenant_lane(Lane.BATCH, "polite")
    await client.aclose()


async def test_entries_xadded_straight_into_an_inactive_tenants_stream_are_found_and_read(redis_url: str) -> None:
    """The fleet walks the key space a slice a turn, one worker a sweep interval, from a cursor they share."""
    from worker.tenant_streams import STRAY_SCAN_CALLS, STRAY_SCAN_COUNT

    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    other = LaneConsumer(client, KEYS, "other", BATCH_ONLY, lease_ms=60_000, read_block_ms=10, max_deliveries=5)
    await consumer.ensure_groups()
    # A producer XADDs into the documented name of a tenant's stream: no consumer group, tenant not active.
    stream = KEYS.tenant_lane(Lane.BATCH, "direct")
    for i in range(3):
        await client.xadd(stream, {"job": f"direct-{i}".encode()})
    await client.xadd(f"{KEYS.lane(Lane.BATCH)}:tenant:no spaces", {"job": b"never a tenant's"})
    # Enough other keys that a walk takes three slices.
    async with client.pipeline(transaction=False) as pipe:
        for i in range(2 * STRAY_SCAN_CALLS * STRAY_SCAN_COUNT + 1):
            pipe.set(f"{KEYS.prefix}:filler:{i}", 1)
        await pipe.execute()
    assert await consumer.read(5) == []  # nobody reads it yet
    turns = []
    while not await client.sismember(KEYS.lane_tenants(Lane.BATCH), "direct"):
        assert len(turns) < 4, turns
        # Within one interval only the first worker walks; the next turn is free once the interval is over.
        found = await consumer.tenants.adopt_strays("reader", 50)
        assert await other.tenants.adopt_strays("other", 50) == []
        turns.append(int(await client.get(KEYS.stray_scan)))
        await asyncio.sleep(0.06)
    assert [s.tenant for s in found] == ["direct"] and await client.smembers(KEYS.lane_tenants(Lane.BATCH)) == {
        b"direct"}
    assert sorted(_names(await consumer.read(5))) == ["direct-0", "direct-1", "direct-2"]
    # Active now, it is not found again in a whole walk; the wake entry it rang is no job.
    await client.delete(KEYS.stray_scan)
    again = []
    for _ in range(6):
        await asyncio.sleep(0.06)
        again += await consumer.tenants.adopt_strays("reader", 50)
        if int(await client.get(KEYS.stray_scan)) == 0:
            break
    assert int(await client.get(KEYS.stray_scan)) == 0 and again == []
    assert _names(await consumer.read(5)) == []
    await client.aclose()
