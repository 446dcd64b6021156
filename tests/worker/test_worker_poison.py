"""Poison entries: whatever a lane entry holds, it ends in a record or on the dead stream within
max_deliveries, the dead-letter path never fails on it, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import Lane
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, xadd_job

LANE = KEYS.lane(Lane.STANDARD)
DEPTH = 100_000


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


def deep_msgpack_job(job_id: str) -> bytes:
    """A msgpack map whose metadata is a list nested DEPTH deep (msgpack.packb itself refuses to write one)."""
    head = msgpack.packb({"id": job_id, "prompt": "x"})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("metadata") + b"\x91" * DEPTH + b"\xc0"


async def wait_settled(client: aioredis.Redis, num_dead: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pending = (await client.xpending(LANE, CONSUMER_GROUP))["pending"]
        dead = await client.xlen(KEYS.dead)
        if pending == 0 and dead >= num_dead:
            return
        assert time.monotonic() < deadline, f"still {pending} pending, {dead} dead (want {num_dead})"
        await asyncio.sleep(0.1)


async def test_poison_entries_end_in_a_record_or_dead_and_the_worker_keeps_serving(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.set(KEYS.job("squatted"), "a string where the job's hash would go")
    poison = {
        "deep-json": ('{"id": "deep-json", "prompt": "x", "metadata": ' + "[" * DEPTH + "]" * DEPTH + "}").encode(),
        "deep-msgpack": deep_msgpack_job("deep-msgpack"),
        "bytes-metadata": msgpack.packb({"id": "bytes-metadata", "prompt": "x", "metadata": {"blob": b"\x00\xff"},
                                         "webhook": {"url": "https://hooks.example/x"}}, use_bin_type=True),
        "surrogate-key": b'{"id": "surrogate-key", "prompt": "x", "\\ud800": 1}',
        "squatted": msgpack.packb({"id": "squatted", "prompt": "x", "params": {"max_tokens": 2}}),
    }
    async with running_worker(redis_url, engine, lease_s=0.3, max_deliveries=2) as service:
        for raw in poison.values():
            await client.xadd(LANE, {"job": raw})
        await wait_settled(client, num_dead=len(poison), timeout_s=30)
        after = JobSpec(id="after", prompt="still serving", params=SamplingParams(max_tokens=3, temperature=0))
        await xadd_job(client, after)
        views = await wait_terminal(client, ["after", "bytes-metadata", "surrogate-key"], timeout_s=30)
        assert not service.has_failed

    assert views["after"]["status"] == "succeeded"
    assert views["bytes-metadata"]["status"] == "failed"
    assert views["bytes-metadata"]["error"]["field"] == "metadata.blob"
    assert views["surrogate-key"]["status"] == "failed"
    dead = {fields[b"job"]: fields[b"reason"].decode() for _, fields in await client.xrange(KEYS.dead)}
    assert set(dead) == set(poison.values())
    assert "too deeply" in dead[poison["deep-json"]]
    assert await client.type(KEYS.job("squatted")) == b"string"  # a foreign key is left as it is
    # The one whose webhook could be read is answered there, failed, as its producer asked.
    deliveries = [(f[b"job_id"], f[b"event"]) for _, f in await client.xrange(KEYS.webhooks)]
    assert deliveries == [(b"bytes-metadata", b"completed")]
    await client.aclose()
