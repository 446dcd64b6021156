"""Every pub/sub event names the attempt (the start of the job) it comes from, so a subscriber can tell a
re-run's events, and a repeated `final`, from the first run's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
import redis.asyncio as aioredis

from scheduler.job import JobSpec
from scheduler.params import SamplingParams
from worker_harness import KEYS, running_worker, wait_terminal, wait_until, xadd_job

SETTINGS = {"lease_s": 600.0, "shutdown_grace_s": 0.0, "checkpoint_tokens": 4}
HELD_TOKENS = 1500
"""Most of the tiny model's context: the first worker cannot finish the job between its first checkpoint and
its hand-back, however fast the engine."""


async def test_events_carry_their_attempt_across_a_hand_back(redis_url: str, tiny_model: Callable[..., str]) -> None:
    from worker.engine import Engine

    engine = Engine(model=tiny_model(), max_num_seqs=2)
    client = aioredis.Redis.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(KEYS.events("twice"))
    events: list[dict[str, Any]] = []

    async def collect() -> None:
        while True:
            message = await pubsub.get_message(timeout=0.5)
            if message is not None:
                events.append(msgpack.unpackb(message["data"]))

    collector = asyncio.create_task(collect())
    try:
        await xadd_job(client, JobSpec(id="twice", prompt="again", params=SamplingParams(max_tokens=HELD_TOKENS, ignore_eos=True)))
        async with running_worker(redis_url, engine, worker_name="first", **SETTINGS):
            await wait_until(lambda: client.hget(KEYS.job("twice"), "checkpoint"), "the first attempt's checkpoint")
        async with running_worker(redis_url, engine, worker_name="second", **SETTINGS):
            (view,) = (await wait_terminal(client, ["twice"])).values()
        await wait_until(lambda: any(e["type"] == "final" for e in events), "the final event at the collector")
    finally:
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        await pubsub.aclose()
        await client.aclose()
    assert view["status"] == "succeeded" and view["attempts"] == 2
    assert all("attempt" in e for e in events), events
    kinds = [(e["type"], e["attempt"]) for e in events]
    assert kinds[0] == ("started", 1) and ("started", 2) in kinds and kinds[-1] == ("final", 2)
    second_start = kinds.index(("started", 2))
    assert {a for t, a in kinds[:second_start] if t == "token"} == {1}
    assert {a for t, a in kinds[second_start:] if t == "token"} == {2}
