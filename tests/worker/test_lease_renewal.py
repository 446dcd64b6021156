"""Lease renewal: a worker resets the idle time only of entries it still owns, in one step per stream."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import DEFAULT_LANE_WEIGHTS, Lane
from tests.harness.worker_harness import KEYS
from worker.consumer import LaneConsumer
from worker.job_store import EntryRef

LANE = KEYS.lane(Lane.STANDARD)


def consumer(client: aioredis.Redis, name: str) -> LaneConsumer:
    return LaneConsumer(client, KEYS, name, DEFAULT_LANE_WEIGHTS, lease_ms=60_000, read_block_ms=10,
                        max_deliveries=5)


async def pending(client: aioredis.Redis, entry_id: str) -> dict[str, object]:
    (info,) = await client.xpending_range(LANE, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
    return {"consumer": info["consumer"].decode(), "idle": info["time_since_delivered"],
            "deliveries": info["times_delivered"]}


async def test_renewal_never_takes_an_entry_another_worker_owns(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    a, b = consumer(client, "worker-a"), consumer(client, "worker-b")
    await a.ensure_groups()
    ids = [(await client.xadd(LANE, {"job": b"x%d" % n})).decode() for n in range(3)]
    assert len(await a.read(3)) == 3
    # Entry 1 was reclaimed by worker B; entry 2 was committed (acknowledged) meanwhile.
    await client.xclaim(LANE, CONSUMER_GROUP, "worker-b", 0, [ids[1]], justid=True)
    await client.xack(LANE, CONSUMER_GROUP, ids[2])
    # Make every entry look idle, so a renewal is visible as a reset idle time.
    await client.xclaim(LANE, CONSUMER_GROUP, "worker-a", 0, [ids[0]], idle=50_000, justid=True)
    await client.xclaim(LANE, CONSUMER_GROUP, "worker-b", 0, [ids[1]], idle=50_000, justid=True)
    before_b = await pending(client, ids[1])

    lost = await a.renew([EntryRef(LANE, i) for i in ids])

    assert lost == {EntryRef(LANE, ids[1]), EntryRef(LANE, ids[2])}
    mine, theirs = await pending(client, ids[0]), await pending(client, ids[1])
    assert mine["consumer"] == "worker-a" and int(str(mine["idle"])) < 10_000
    assert theirs == {**before_b, "idle": theirs["idle"]} and theirs["consumer"] == "worker-b"
    assert int(str(theirs["idle"])) >= 50_000  # B's entry was not touched by A's renewal
    assert (await client.xpending(LANE, CONSUMER_GROUP))["pending"] == 2
    assert await b.renew([EntryRef(LANE, ids[1])]) == set()
    assert (await pending(client, ids[1]))["deliveries"] == before_b["deliveries"]  # renewals count no delivery
    await client.aclose()


async def test_reclaim_finds_a_lapsed_entry_behind_many_renewed_ones(redis_url: str) -> None:
    """One lapsed lease behind a run of entries still renewed (a busy lane): taken with a single free slot, with
    its deliveries counted; one deleted while pending is taken too (only to be acknowledged)."""
    client = aioredis.Redis.from_url(redis_url)
    a, b = consumer(client, "worker-a"), consumer(client, "worker-b")
    await a.ensure_groups()
    ids = [(await client.xadd(LANE, {"job": b"x%d" % n})).decode() for n in range(40)]
    assert len(await a.read(40)) == 40
    await client.xclaim(LANE, CONSUMER_GROUP, "worker-a", 0, [ids[30]], idle=120_000, justid=True)  # lapsed
    await client.xclaim(LANE, CONSUMER_GROUP, "worker-a", 0, [ids[35]], idle=120_000, justid=True)  # lapsed...
    await client.xdel(LANE, ids[35])  # ... and deleted meanwhile

    first = await b.reclaim(1)
    second = await b.reclaim(5)
    is_redis_7 = int((await client.info("server"))["redis_version"].split(".")[0]) >= 7

    assert [(e.ref.entry_id, e.fields, e.deliveries) for e in first] == [(ids[30], {b"job": b"x30"}, 2)], first
    if is_redis_7:  # the claim drops a deleted entry from the pending list itself
        assert second == [] and not await client.xpending_range(LANE, CONSUMER_GROUP, min=ids[35], max=ids[35],
                                                                 count=1)
    else:  # Redis 6.2 hands it over, its fields gone: taken only to be acknowledged
        assert [(e.ref.entry_id, e.fields) for e in second] == [(ids[35], None)], second
        assert (await pending(client, ids[35]))["consumer"] == "worker-b"
    assert await b.reclaim(5) == []  # the 38 others are worker A's, renewed
    await client.aclose()


@pytest.mark.parametrize("lease", ["inf", "nan", "0", "1e-9", "0.05"])
def test_a_lease_no_worker_could_keep_is_refused_at_start(lease: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Infinite (never reclaimed, and no lease in milliseconds to give Redis) or shorter than a renewal's round
    trip: one line naming the setting, exit 2, before any model loads."""
    from gateway.cli.main import main

    assert main(["worker", "--lease-s", lease], env={}) == 2
    err = capsys.readouterr().err
    assert "carpool worker: --lease-s: must be" in err and "Traceback" not in err, err
