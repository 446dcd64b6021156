"""Lane weighting: interactive work overtakes a deep batch backlog, and the batch lane never starves."""

from __future__ import annotations

import statistics

import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.lanes import DEFAULT_LANE_WEIGHTS, Lane
from tests.harness.worker_harness import KEYS, TERMINAL, running_worker, wait_terminal, wait_until, xadd_job
from worker.consumer import LaneConsumer, LaneShares


def test_lane_shares_follow_the_weights_and_interleave():
    shares = LaneShares(DEFAULT_LANE_WEIGHTS)
    picks = [shares.pick() for _ in range(12 * 10)]
    assert picks.count(Lane.INTERACTIVE) == 80 and picks.count(Lane.STANDARD) == 30 and picks.count(Lane.BATCH) == 10
    gaps = [i for i, lane in enumerate(picks) if lane is Lane.BATCH]
    assert max(b - a for a, b in zip(gaps, gaps[1:])) == 12  # smooth: batch gets a turn every 12 picks
    assert LaneShares(DEFAULT_LANE_WEIGHTS).split(12) == {Lane.INTERACTIVE: 8, Lane.STANDARD: 3, Lane.BATCH: 1}


async def test_a_read_takes_the_weighted_shares_and_a_short_lane_passes_its_slots_on(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    consumer = LaneConsumer(client, KEYS, "reader", DEFAULT_LANE_WEIGHTS, lease_ms=60_000, read_block_ms=10,
                            max_deliveries=5)
    await consumer.ensure_groups()
    for lane, n in ((Lane.INTERACTIVE, 2), (Lane.STANDARD, 20), (Lane.BATCH, 20)):
        for i in range(n):
            await client.xadd(KEYS.lane(lane), {"job": f"{lane.value}-{i}".encode()})
    # Shares of 12: interactive 8 (only 2 there), standard 3, batch 1; interactive's 6 go to standard, the next lane.
    got = await consumer.read(12)
    by_lane = {lane: [e.fields[b"job"].decode() for e in got if e.lane is lane] for lane in Lane}
    assert by_lane == {Lane.INTERACTIVE: ["interactive-0", "interactive-1"],
                       Lane.STANDARD: [f"standard-{i}" for i in range(9)], Lane.BATCH: ["batch-0"]}
    # Never more than asked for, and nothing read twice.
    assert len(await consumer.read(5)) == 5
    rest = await consumer.read(100)
    assert len(rest) == 42 - 12 - 5
    assert len({e.ref for e in got + rest}) == len(got) + len(rest)
    assert await consumer.read(4) == []  # every lane empty: a short blocking read, then nothing
    await client.aclose()


async def num_finished(client: aioredis.Redis, specs: list[JobSpec]) -> int:
    async with client.pipeline(transaction=False) as pipe:
        for spec in specs:
            pipe.hget(KEYS.job(spec.id), "status")
        return sum(raw is not None and raw.decode() in TERMINAL for raw in await pipe.execute())


async def test_interactive_jobs_overtake_a_batch_backlog(redis_url, tiny_model):
    from worker.engine.engine import Engine

    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    batch = [JobSpec(id=f"b{i}", prompt=f"batch {i}", params=params, lane=Lane.BATCH) for i in range(200)]
    interactive = [JobSpec(id=f"i{i}", prompt=f"interactive {i}", params=params, lane=Lane.INTERACTIVE)
                   for i in range(20)]
    for spec in batch:
        await xadd_job(client, spec)
    engine = Engine(model=tiny_model(), max_num_seqs=8, policy="priority")
    async with running_worker(redis_url, engine):
        await wait_until(lambda: num_finished(client, batch), "the backlog draining")
        # Steady interactive traffic while the backlog drains, paced by the worker rather than the clock: one
        # job at a time, the next as soon as the last one is done.
        for spec in interactive:
            await xadd_job(client, spec)
            await wait_terminal(client, [spec.id])
        views = await wait_terminal(client, [s.id for s in batch + interactive])
    assert all(v["status"] == "succeeded" for v in views.values())
    wait_batch = statistics.median(views[s.id]["timings"]["queued_s"] for s in batch)
    wait_interactive = statistics.median(views[s.id]["timings"]["queued_s"] for s in interactive)
    assert wait_interactive < wait_batch / 10, (wait_interactive, wait_batch)
    window = (min(views[s.id]["created_at"] for s in interactive), max(views[s.id]["finished_at"] for s in interactive))
    batch_done_meanwhile = sum(1 for s in batch if window[0] <= views[s.id]["finished_at"] <= window[1])
    assert batch_done_meanwhile >= 5, batch_done_meanwhile  # the batch lane keeps moving under interactive load
    await client.aclose()
