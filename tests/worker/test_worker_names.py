"""Two live workers may not share a name: the second is refused at start with one line. A worker restarted under
the name of one that was killed (its heartbeat left behind) starts."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis

from tests.harness.child_env import stop_process
from tests.harness.worker_harness import KEYS, start_worker_process, wait_until


async def _beat_time(client: aioredis.Redis, name: str) -> float | None:
    raw = await client.hget(KEYS.workers, name)
    return None if raw is None else float(msgpack.unpackb(raw)["time"])


@pytest.mark.slow
async def test_a_second_live_worker_of_the_same_name_is_refused_and_a_killed_ones_successor_starts(
    redis_url: str, tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    model = tiny_model()
    client = aioredis.Redis.from_url(redis_url)
    first = start_worker_process(redis_url, model, "twin", tmp_path / "first.log", "--heartbeat-interval-s", "0.5")
    procs = [first]
    try:
        await wait_until(lambda: client.hexists(KEYS.workers, "twin"), "the first worker's heartbeat", 120)
        second = start_worker_process(redis_url, model, "twin", tmp_path / "second.log", "--heartbeat-interval-s", "0.5")
        procs.append(second)
        assert second.wait(timeout=120) == 1
        said = (tmp_path / "second.log").read_text()
        assert "carpool worker: another live worker is named 'twin' under the key prefix 'carpool'" in said, said
        assert first.poll() is None  # the first goes on
        # Killed, it leaves a recent heartbeat behind: a worker restarted under its name is not refused for it.
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        left = await _beat_time(client, "twin")
        assert left is not None
        third = start_worker_process(redis_url, model, "twin", tmp_path / "third.log", "--heartbeat-interval-s", "0.5")
        procs.append(third)

        async def renewed() -> bool:
            at = await _beat_time(client, "twin")
            return at is not None and at > left

        await wait_until(renewed, "the restarted worker's heartbeat", 120)
        assert third.poll() is None, (tmp_path / "third.log").read_text()
    finally:
        for proc in procs:
            stop_process(proc, 30)
        await client.aclose()
