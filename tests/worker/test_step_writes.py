"""One script call per engine step: token events in order, webhook deliveries, checkpoints only while ours."""

from __future__ import annotations

import asyncio

import msgpack
import redis.asyncio as aioredis

from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash
from worker.job_store import unpack_checkpoint
from worker.step_writes import (
    CHECKPOINT_CANCEL_FLAGGED,
    CHECKPOINT_NO_RECORD,
    CHECKPOINT_NOT_OURS,
    CHECKPOINT_STORED,
    StepWriter,
    StepWrites,
)

WORKER = "w1"


async def _running(redis: aioredis.Redis, keys: Keys, job_id: str, worker: str = WORKER) -> None:
    await redis.hset(keys.job(job_id), mapping={"id": job_id, "status": "running", "worker": worker})


async def test_events_deliveries_and_checkpoints_in_one_call(redis: aioredis.Redis) -> None:
    keys = Keys("t")
    for job_id in ("a", "b", "c"):
        await _running(redis, keys, job_id)
    await redis.hset(keys.job("b"), "worker", "someone-else")
    await redis.set(keys.cancel("c"), 1)
    await redis.hset(keys.job("e"), mapping={"id": "e", "status": "cancelled", "worker": WORKER})  # ended meanwhile
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.events("a"), keys.events("b"))
    for _ in range(2):  # both subscriptions confirmed before anything is published
        assert (await pubsub.get_message(timeout=1.0) or {}).get("type") == "subscribe"
    writes = StepWrites()
    for index in range(3):
        writes.publish("a", msgpack.packb({"index": index}))
    writes.publish("b", msgpack.packb({"index": 0}))
    writes.deliver("a", {"id": b"d1", "job_id": b"a", "event": b"output"})
    writes.deliver("b", {"id": b"d2", "job_id": b"b", "event": b"output"})
    writes.publish("c", msgpack.packb({"index": 0}))
    writes.publish("e", msgpack.packb({"index": 5}))
    writes.deliver("e", {"id": b"d3", "job_id": b"e", "event": b"output"})
    stored = writes.checkpoint("a", [5, 6, 7], 12.5)
    lost = writes.checkpoint("b", [1], None)
    flagged = writes.checkpoint("c", [9, 9], 3.0, [{"token_id": 9, "logprob": -0.5}] * 2)
    gone = writes.checkpoint("d", [1], None)  # no record: deleted, or lost by Redis

    replies = await StepWriter(redis, keys, WORKER).write(writes)

    assert (replies[stored], replies[lost], replies[flagged], replies[gone]) == (
        CHECKPOINT_STORED, CHECKPOINT_NOT_OURS, CHECKPOINT_CANCEL_FLAGGED, CHECKPOINT_NO_RECORD)
    assert not await redis.exists(keys.job("d"))  # no checkpoint makes a record of its own
    record = await read_hash(redis, keys.job("a"))
    assert unpack_checkpoint(record[b"checkpoint"]) == ([5, 6, 7], None)
    assert record[b"first_token_at"] == b"12.5"
    assert b"checkpoint" not in await read_hash(redis, keys.job("b"))  # not ours: untouched
    tokens, logprobs = unpack_checkpoint((await read_hash(redis, keys.job("c")))[b"checkpoint"])
    assert tokens == [9, 9] and logprobs is not None and len(logprobs) == 2
    deliveries = [fields for _, fields in await redis.xrange(keys.webhooks) or []]
    assert deliveries == [{b"id": b"d1", b"job_id": b"a", b"event": b"output"}]
    received: list[tuple[bytes, int]] = []
    while len(received) < 3:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        assert message is not None, f"only {received} arrived"
        received.append((message["channel"], msgpack.unpackb(message["data"])["index"]))
    assert received == [(keys.events("a").encode(), 0), (keys.events("a").encode(), 1),
                        (keys.events("a").encode(), 2)]
    # b runs on another worker: nothing of this one's for it is sent (its webhook d2 above neither); c, whose
    # cancel is flagged, is still ours until the worker ends it.
    assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.3) is None
    assert not await redis.exists(keys.events_log("b")) and await redis.xlen(keys.events_log("c")) == 1
    assert not await redis.exists(keys.events_log("e"))  # ended: its last webhook was its `completed`
    await pubsub.aclose()


async def test_first_token_time_is_kept_and_nothing_is_sent_for_an_empty_step(redis: aioredis.Redis) -> None:
    keys = Keys("t")
    await _running(redis, keys, "a")
    writer = StepWriter(redis, keys, WORKER)
    assert await writer.write(StepWrites()) == []
    first = StepWrites()
    first.checkpoint("a", [1], 1.0)
    later = StepWrites()
    later.checkpoint("a", [1, 2], 2.0)
    assert await writer.write(first) == [CHECKPOINT_STORED]
    assert await writer.write(later) == [CHECKPOINT_STORED]
    record = await read_hash(redis, keys.job("a"))
    assert record[b"first_token_at"] == b"1.0"
    assert unpack_checkpoint(record[b"checkpoint"]) == ([1, 2], None)


async def test_the_script_is_reloaded_after_redis_forgets_it(redis: aioredis.Redis) -> None:
    keys = Keys("t")
    await _running(redis, keys, "a")
    writer = StepWriter(redis, keys, WORKER)
    writes = StepWrites()
    writes.checkpoint("a", [4], None)
    assert await writer.write(writes) == [CHECKPOINT_STORED]
    await redis.script_flush()
    await asyncio.sleep(0)
    assert await writer.write(writes) == [CHECKPOINT_STORED]
