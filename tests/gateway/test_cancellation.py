"""Owned loops stop when cancelled, even when Python 3.11's `wait_for` (inside redis-py) drops the cancel."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.event_hub import EventHub
from scheduler.protocol.keys import Keys
from scheduler.runtime.tasks import cancel_and_reap, raise_if_cancelled
from scheduler.telemetry.stream_stats import StreamStats

NUM_ROUNDS = 60
STOP_WITHIN_S = 2.0


async def _stops_promptly(stop: Coroutine[Any, Any, None]) -> None:
    """Not `wait_for`: its timeout would cancel `stop`, which cancels the loop a second time and hides the bug."""
    stopping = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({stopping}, timeout=STOP_WITHIN_S)
    assert done, f"the loop was still running {STOP_WITHIN_S}s after it was cancelled"
    stopping.result()


async def _cancel_lands_with_a_result() -> asyncio.Task[None]:
    """A loop whose `wait_for` finishes in the very turn its task is cancelled; returns the task after the cancel."""
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def poll() -> None:
        while True:
            await asyncio.wait_for(inner, timeout=60)
            raise_if_cancelled()
            await asyncio.sleep(3600)

    task = asyncio.create_task(poll())
    await asyncio.sleep(0)  # the task now waits inside wait_for
    inner.set_result(1)
    task.cancel()
    await asyncio.wait({task}, timeout=0.2)
    return task


async def test_a_cancel_lost_inside_wait_for_still_stops_a_checking_loop() -> None:
    task = await _cancel_lands_with_a_result()
    assert task.cancelled()


async def test_cancel_and_reap_surfaces_the_error_that_ended_the_task() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="boom"):
        await cancel_and_reap(task)


async def test_stream_stats_stops_whenever_it_is_cancelled(redis_url: str) -> None:
    rng = random.Random(7)
    for _ in range(NUM_ROUNDS):
        client = aioredis.Redis.from_url(redis_url)  # a fresh client: the cancel can land mid-connect
        stats = StreamStats(client, Keys(), interval_s=5.0)
        stats.start()
        await asyncio.sleep(rng.random() * 0.004)
        await _stops_promptly(stats.aclose())
        await client.aclose()


async def test_event_hub_stops_whenever_it_is_cancelled(redis_url: str) -> None:
    rng = random.Random(11)
    for _ in range(NUM_ROUNDS):
        client = aioredis.Redis.from_url(redis_url)
        hub = EventHub(client)
        hub.start()
        async with hub.subscribe("carpool:test:cancel"):
            pass
        await asyncio.sleep(rng.random() * 0.004)
        await _stops_promptly(hub.stop())
        await client.aclose()
