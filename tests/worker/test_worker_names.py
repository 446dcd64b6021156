"""Two live workers may not share a name: the second is refused at start with one line, also where both start at
the same moment. A worker restarted under the name of one that was killed (its heartbeat left behind) starts."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis

from tests.harness.child_env import stop_process
from tests.harness.worker_harness import KEYS, start_worker_process, wait_until
from worker.service import WorkerNameTaken, claim_name, claim_ttl_ms, release_name, renew_name


async def _beat_time(client: aioredis.Redis, name: str) -> float | None:
    raw = await client.hget(KEYS.workers, name)
    return None if raw is None else float(msgpack.unpackb(raw)["time"])


@pytest.mark.slow
async def test_a_second_live_worker_of_the_same_name_is_refused_and_a_killed_ones_successor_starts(
    redis_url: str, tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    model = tiny_model()
    client = aioredis.Redis.from_url(redis_url)
    # Two started together both pass the heartbeat check (neither has beaten yet): the name's claim lets one on,
    # and the other leaves the running one's heartbeat alone (its next beat is a second away). A short Redis timeout
    # keeps the claim's time to live short (three intervals), for the restart below.
    procs = [start_worker_process(redis_url, model, "twin", tmp_path / f"together-{i}.log", "--heartbeat-interval-s",
                                  "1", "--redis-timeout-s", "1") for i in range(2)]
    try:
        await wait_until(lambda: any(proc.poll() is not None for proc in procs), "one of the two to exit", 120)
        refused = next(i for i, proc in enumerate(procs) if proc.poll() is not None)
        assert procs[refused].wait() == 1
        assert await client.hexists(KEYS.workers, "twin"), "the refused twin removed the running one's heartbeat"
        said = (tmp_path / f"together-{refused}.log").read_text()
        assert "carpool worker: another live worker is named 'twin' under the key prefix 'carpool' (it holds the " \
               "name's claim" in said, said
        first = procs[1 - refused]
        # One started later is refused before its model loads, by the heartbeat.
        second = start_worker_process(redis_url, model, "twin", tmp_path / "second.log", "--heartbeat-interval-s", "0.5")
        procs.append(second)
        assert second.wait(timeout=120) == 1
        said = (tmp_path / "second.log").read_text()
        assert "carpool worker: another live worker is named 'twin' under the key prefix 'carpool' (its heartbeat " \
               "was renewed" in said, said
        assert first.poll() is None  # the first goes on
        assert await client.hexists(KEYS.workers, "twin")
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


async def test_of_two_claims_on_one_name_at_once_one_is_had_and_a_lapsed_claim_is_taken_over(redis_url: str) -> None:
    """The claim that the heartbeat check cannot give: of two workers claiming one name at the same moment, one
    gets it and the other is refused while the holder renews it (as its heartbeats do); a claim that nothing
    renews any more (a killed worker's) is waited out and taken; giving it back deletes only one's own."""
    client = aioredis.Redis.from_url(redis_url)
    interval_s = 0.2
    ttl_ms = claim_ttl_ms(interval_s, 0.1)
    assert ttl_ms == 600, "three intervals, at least an interval and a Redis timeout"
    key = KEYS.worker_claim("pair")

    async def renew_the_holders() -> None:
        while True:
            await asyncio.sleep(interval_s)
            holder = await client.get(key)
            if holder is not None:
                await client.set(key, holder, xx=True, px=ttl_ms)

    try:
        renewing = asyncio.create_task(renew_the_holders())
        try:
            outcomes = await asyncio.gather(*(claim_name(client, KEYS, "pair", token, ttl_ms)
                                              for token in ("a", "b")), return_exceptions=True)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        assert sorted(type(outcome).__name__ for outcome in outcomes) == ["NoneType", "WorkerNameTaken"], outcomes
        assert "another live worker is named 'pair'" in str(next(o for o in outcomes if o is not None))
        assert await client.get(key) == (b"a" if outcomes[0] is None else b"b")
        holder = "a" if outcomes[0] is None else "b"
        await renew_name(client, KEYS, "pair", holder, ttl_ms)
        # Its holder gone (nothing renews it): lapses within its time to live, and the next one takes the name.
        await claim_name(client, KEYS, "pair", "successor", ttl_ms)
        assert await client.get(key) == b"successor"
        # The old holder, back after its claim lapsed (a stalled worker), finds the name taken: it stops.
        with pytest.raises(WorkerNameTaken, match="another worker took the name 'pair'"):
            await renew_name(client, KEYS, "pair", holder, ttl_ms)
        assert await client.get(key) == b"successor"
        await release_name(client, KEYS, "pair", "someone else")
        assert await client.get(key) == b"successor", "another's token gives nothing back"
        await release_name(client, KEYS, "pair", "successor")
        assert await client.exists(key) == 0
    finally:
        await client.delete(key)
        await client.aclose()
