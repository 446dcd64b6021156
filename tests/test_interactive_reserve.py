"""The interactive reserve: with every slot busy on long batch jobs, an interactive job still starts at once.

A real worker on a real redis-server and a tiny model: the worker takes the
interactive entry beyond its free slots, the engine preempts a batch job for
it, and every job, the preempted one included, still ends with exactly the
offline engine's greedy output.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from scheduler.job import JobSpec
from scheduler.keys import CONSUMER_GROUP
from scheduler.lanes import Lane
from scheduler.params import SamplingParams
from worker.config import WorkerConfig
from worker_harness import KEYS, running_worker, status_of, wait_terminal, xadd_job

SLOTS = 4
BATCH_TOKENS = 160
INTERACTIVE_TOKENS = 4


def test_reserve_defaults_and_is_off_where_the_engine_would_not_preempt() -> None:
    assert WorkerConfig(max_num_seqs=4).reserve == 1
    assert WorkerConfig(max_num_seqs=64).reserve == 8
    assert WorkerConfig(max_num_seqs=64, interactive_reserve=0).reserve == 0
    assert WorkerConfig(max_num_seqs=64, interactive_reserve=3).reserve == 3
    assert WorkerConfig(max_num_seqs=64, policy="fcfs").reserve == 0
    assert WorkerConfig(max_num_seqs=64, batching="static").reserve == 0


async def test_interactive_job_preempts_a_full_batch_backlog(redis_url, tiny_model):
    from worker.engine import Engine

    model = tiny_model()
    batch_params = SamplingParams(max_tokens=BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    quick = SamplingParams(max_tokens=INTERACTIVE_TOKENS, temperature=0.0, ignore_eos=True)
    # One more batch job than slots: it must stay in its lane, not be hoarded by the reserve.
    batch = [JobSpec(id=f"batch-{i}", prompt=f"a long batch job number {i}", params=batch_params, lane=Lane.BATCH)
             for i in range(SLOTS + 1)]
    interactive = JobSpec(id="chat-1", prompt="a quick interactive question", params=quick, lane=Lane.INTERACTIVE)
    client = aioredis.Redis.from_url(redis_url)
    engine = Engine(model=model, max_num_seqs=SLOTS, policy="priority")
    async with running_worker(redis_url, engine) as service:
        assert service.config.reserve == 1
        for spec in batch:
            await xadd_job(client, spec)
        deadline = time.monotonic() + 30
        while sum([await status_of(client, s.id) == "running" for s in batch]) < SLOTS:
            assert time.monotonic() < deadline, "the batch jobs never filled the slots"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the batch jobs are decoding now
        assert service.loop.free == 0
        held = await client.xpending(KEYS.lane(Lane.BATCH), CONSUMER_GROUP)
        assert held["pending"] == SLOTS, "the reserve takes nothing from the batch lane"
        steps_before = service.loop.stats.num_steps
        await xadd_job(client, interactive)
        while await status_of(client, interactive.id) != "succeeded":
            await asyncio.sleep(0.005)
        steps_to_finish = service.loop.stats.num_steps - steps_before
        batch_statuses = [await status_of(client, s.id) for s in batch]
        views = await wait_terminal(client, [s.id for s in batch] + [interactive.id], timeout_s=120)
        stats = engine.stats()

    # It ran within a few steps of its arrival (4 tokens; about 8 steps here, up to its commit being seen),
    # while every batch job, 160 steps long, was still running. Without the reserve: over 100 steps.
    assert steps_to_finish <= 10 * INTERACTIVE_TOKENS, steps_to_finish
    assert "succeeded" not in batch_statuses, batch_statuses
    chat = views[interactive.id]
    assert chat["started_at"] < min(views[s.id]["finished_at"] for s in batch)
    assert chat["timings"]["queued_s"] < 1.0, chat["timings"]
    assert stats.num_priority_preemptions >= 1
    # Everyone, the preempted batch job included, got exactly the offline engine's greedy output.
    reference = Engine(model=model, max_num_seqs=SLOTS)
    expected = reference.generate([s.prompt for s in batch], batch_params) + reference.generate(
        [interactive.prompt], quick)
    for spec, completion in zip(batch + [interactive], expected):
        view = views[spec.id]
        assert view["status"] == "succeeded", view
        assert view["output"]["token_ids"] == completion.token_ids, spec.id
        assert view["attempts"] == 1
    for lane in Lane:
        assert (await client.xpending(KEYS.lane(lane), CONSUMER_GROUP))["pending"] == 0
    await client.aclose()


async def test_an_idle_worker_gets_the_interactive_job_before_a_busy_workers_reserve(redis_url, tiny_model):
    from worker.engine import Engine

    model = tiny_model()
    # Long enough to hold every busy slot until the chats are done: a busy worker whose batch job ends has a
    # free slot, and then rightly takes a chat.
    batch_params = SamplingParams(max_tokens=6 * BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    quick = SamplingParams(max_tokens=INTERACTIVE_TOKENS, temperature=0.0, ignore_eos=True)
    batch = [JobSpec(id=f"batch-{i}", prompt=f"batch job {i}", params=batch_params, lane=Lane.BATCH)
             for i in range(SLOTS)]
    chats = [JobSpec(id=f"chat-{i}", prompt=f"question {i}", params=quick, lane=Lane.INTERACTIVE) for i in range(3)]
    client = aioredis.Redis.from_url(redis_url)
    busy_engine = Engine(model=model, max_num_seqs=SLOTS, policy="priority")
    async with running_worker(redis_url, busy_engine, worker_name="busy") as busy:
        for spec in batch:
            await xadd_job(client, spec)
        deadline = time.monotonic() + 30
        while busy.loop.free:
            assert time.monotonic() < deadline, "the batch jobs never filled the busy worker"
            await asyncio.sleep(0.02)
        async with running_worker(redis_url, Engine(model=model, max_num_seqs=SLOTS, policy="priority"),
                                  worker_name="idle"):
            for spec in chats:
                # The claim is about an idle worker blocked on the lanes: give it time to get back to its
                # blocking read (after the last chat's commit) before the entry arrives.
                await asyncio.sleep(0.3)
                await xadd_job(client, spec)
                chat_views = await wait_terminal(client, [spec.id], timeout_s=30)
                assert busy.loop.free == 0, "a batch job ended during the chats: the busy worker was not busy"
                assert chat_views[spec.id]["worker"] == "idle", chat_views[spec.id]
            assert busy_engine.stats().num_priority_preemptions == 0
            views = await wait_terminal(client, [s.id for s in batch], timeout_s=120)
    assert all(views[s.id]["status"] == "succeeded" and views[s.id]["worker"] == "busy" for s in batch)
    await client.aclose()
