"""How a batch's requests are counted when their results stream lost them: the scan of their job records."""

from __future__ import annotations

import msgpack
import redis.asyncio as aioredis

from gateway.openai.batch_counts import RECORDS_PER_ROUND_TRIP, BatchCounts
from gateway.openai.batches import COUNTERS
from scheduler.protocol.keys import Keys

KEYS = Keys()
BATCH = "batch_scan"


def usage_of(number: int) -> dict[str, int]:
    return {"prompt_tokens": 10 + number, "cached_tokens": number % 3, "completion_tokens": 2 * number}


async def test_a_scan_counts_each_finished_request_once_across_its_round_trips(redis_url: str) -> None:
    """Request i ends by i % 5: succeeded, failed, expired, its record gone (counted failed), or still running.
    The lines span several round trips of the scan, so every one of them must be read, counted by its own
    outcome, and the low-water mark must stop at the first request still running."""
    redis = aioredis.Redis.from_url(redis_url)
    counts = BatchCounts(redis, KEYS, ttl_s=600)
    total = 3 * RECORDS_PER_ROUND_TRIP + 7
    first_running = RECORDS_PER_ROUND_TRIP + 13  # past the first round trip
    await redis.hset(KEYS.batch(BATCH), mapping={**{name: 0 for name in COUNTERS}, "total": total, "enqueued": total})
    statuses = {n: ("succeeded", "failed", "expired", None, "succeeded")[n % 5] for n in range(total)}
    statuses[first_running] = "running"
    statuses.update({n: "queued" for n in range(first_running + 1, total, 7)})
    for number, status in statuses.items():
        if status is not None:
            await redis.hset(KEYS.job(f"{BATCH}-{number}"), mapping={
                "status": status, **({"usage": msgpack.packb(usage_of(number))} if status == "succeeded" else {})})

    for _ in range(2):  # a second scan finds nothing new to count
        batch = {k.decode(): v.decode() for k, v in (await redis.hgetall(KEYS.batch(BATCH))).items()}
        await counts.scan(BATCH, batch, is_cancelling=False)
        after = {k.decode(): v.decode() for k, v in (await redis.hgetall(KEYS.batch(BATCH))).items()}
        completed = [n for n, s in statuses.items() if s == "succeeded"]
        assert int(after["completed"]) == len(completed)
        assert int(after["failed"]) == sum(1 for s in statuses.values() if s in ("failed", "expired", None))
        assert int(after["expired"]) == sum(1 for s in statuses.values() if s == "expired")
        assert int(after["settled"]) == int(after["completed"]) + int(after["failed"])
        assert int(after["input_tokens"]) == sum(usage_of(n)["prompt_tokens"] for n in completed)
        assert int(after["cached_tokens"]) == sum(usage_of(n)["cached_tokens"] for n in completed)
        assert int(after["output_tokens"]) == sum(usage_of(n)["completion_tokens"] for n in completed)
        assert int(after["low"]) == first_running
        settled = await counts.settled_bits(BATCH, 0, total)
        assert [n for n in range(total) if not settled[n]] == [
            n for n, s in statuses.items() if s in ("running", "queued")]

    for number, status in statuses.items():  # the rest end: the mark passes the whole window
        if status in ("running", "queued"):
            statuses[number] = "succeeded"
            await redis.hset(KEYS.job(f"{BATCH}-{number}"), mapping={
                "status": "succeeded", "usage": msgpack.packb(usage_of(number))})
    await counts.scan(BATCH, {k.decode(): v.decode() for k, v in (await redis.hgetall(KEYS.batch(BATCH))).items()},
                      is_cancelling=False)
    after = {k.decode(): v.decode() for k, v in (await redis.hgetall(KEYS.batch(BATCH))).items()}
    assert int(after["settled"]) == total and int(after["low"]) == total
    assert int(after["completed"]) == sum(1 for s in statuses.values() if s == "succeeded")
    assert int(after["output_tokens"]) == sum(usage_of(n)["completion_tokens"]
                                              for n, s in statuses.items() if s == "succeeded")
    await redis.aclose()
