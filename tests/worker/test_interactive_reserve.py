"""The interactive reserve: with every slot busy on long batch jobs, an interactive job still starts at once.

A real worker on a real redis-server and a tiny model: the worker takes the
interactive entry beyond its free slots, the engine preempts a batch job for
it, and every job, the preempted one included, still ends with exactly the
offline engine's greedy output.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import Lane
from tests.harness.worker_harness import KEYS, StepLog, has_status, running_worker, status_of, wait_terminal, wait_until, xadd_job
from worker.config import WorkerConfig

SLOTS = 4
BATCH_TOKENS = 1500
"""Far more engine steps than pass between the slots filling and the interactive job's end (a few Redis round
trips and the reserve's poll), so the batch jobs hold their slots throughout at any engine speed."""
INTERACTIVE_TOKENS = 4


def test_reserve_defaults_and_is_off_where_the_engine_would_not_preempt() -> None:
    assert WorkerConfig.of(max_num_seqs=4).reserve == 1
    assert WorkerConfig.of(max_num_seqs=64).reserve == 8
    assert WorkerConfig.of(max_num_seqs=64, interactive_reserve=0).reserve == 0
    assert WorkerConfig.of(max_num_seqs=64, interactive_reserve=3).reserve == 3
    assert WorkerConfig.of(max_num_seqs=64, policy="fcfs").reserve == 0
    assert WorkerConfig.of(max_num_seqs=64, batching="static").reserve == 0


async def test_interactive_job_preempts_a_full_batch_backlog(redis_url, tiny_model):
    from worker.engine.engine import Engine

    model = tiny_model()
    batch_params = SamplingParams(max_tokens=BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    quick = SamplingParams(max_tokens=INTERACTIVE_TOKENS, temperature=0.0, ignore_eos=True)
    # One more batch job than slots: it must stay in its lane, not be hoarded by the reserve (it runs once a slot
    # frees, so its length does not matter).
    batch = [JobSpec(id=f"batch-{i}", prompt=f"a long batch job number {i}", params=batch_params, lane=Lane.BATCH)
             for i in range(SLOTS)]
    batch.append(JobSpec(id=f"batch-{SLOTS}", prompt=f"a long batch job number {SLOTS}", params=quick, lane=Lane.BATCH))
    interactive = JobSpec(id="chat-1", prompt="a quick interactive question", params=quick, lane=Lane.INTERACTIVE)
    client = aioredis.Redis.from_url(redis_url)
    engine = Engine(model=model, max_num_seqs=SLOTS, policy="priority")
    steps = StepLog(engine)
    async with running_worker(redis_url, steps) as service:
        assert service.config.reserve == 1
        for spec in batch:
            await xadd_job(client, spec)
        await wait_until(lambda: service.job_loop.free == 0 and len(service.job_loop.jobs) == SLOTS
                         and all(job.token_ids for job in service.job_loop.jobs.values()),
                         "every slot decoding a batch job")
        held = await client.xpending(KEYS.lane(Lane.BATCH), CONSUMER_GROUP)
        assert held["pending"] == SLOTS, "the reserve takes nothing from the batch lane"
        await xadd_job(client, interactive)
        await wait_until(lambda: has_status(client, interactive.id, "succeeded"), "the interactive job succeeded")
        batch_statuses = [await status_of(client, s.id) for s in batch]
        views = await wait_terminal(client, [s.id for s in batch] + [interactive.id])
        stats = engine.stats()

    # Once in the engine it ran straight through (4 tokens: one prefill step and three decode steps), while
    # every batch job, BATCH_TOKENS steps long, was still running: without the reserve it would have waited
    # for one of them to end. Counted in engine steps, so it holds at any engine speed.
    steps_in_engine = steps.finished_at[interactive.id] - steps.added_at[interactive.id] + 1
    assert steps_in_engine <= 10 * INTERACTIVE_TOKENS, steps_in_engine
    first_batch_end = min(steps.finished_at[s.id] for s in batch)
    assert steps.added_at[interactive.id] < first_batch_end, (steps.added_at, steps.finished_at)
    assert steps.finished_at[interactive.id] < first_batch_end, (steps.added_at, steps.finished_at)
    assert "succeeded" not in batch_statuses, batch_statuses
    chat = views[interactive.id]
    assert chat["started_at"] < min(views[s.id]["finished_at"] for s in batch)
    assert chat["finished_at"] < min(views[s.id]["finished_at"] for s in batch)
    assert stats.num_priority_preemptions >= 1
    # Everyone, the preempted batch job included, got exactly the offline engine's greedy output.
    reference = Engine(model=model, max_num_seqs=SLOTS + 2)
    expected = reference.generate([s.prompt for s in batch + [interactive]], [s.params for s in batch + [interactive]])
    for spec, completion in zip(batch + [interactive], expected):
        view = views[spec.id]
        assert view["status"] == "succeeded", view
        assert view["output"]["token_ids"] == completion.token_ids, spec.id
        assert view["attempts"] == 1
    for lane in Lane:
        assert (await client.xpending(KEYS.lane(lane), CONSUMER_GROUP))["pending"] == 0
    await client.aclose()


async def _blocked_on_the_lanes(client: aioredis.Redis) -> bool:
    """Some worker waits in a blocking XREADGROUP (only a worker with a free slot blocks; a full one polls)."""
    return any(info["cmd"] == "xreadgroup" and "b" in info["flags"] for info in await client.client_list())


async def test_an_idle_worker_gets_the_interactive_job_before_a_busy_workers_reserve(redis_url, tiny_model):
    from worker.engine.engine import Engine

    model = tiny_model()
    # Long enough to hold every busy slot until the chats are done: a busy worker whose batch job ends has a
    # free slot, and then rightly takes a chat.
    batch_params = SamplingParams(max_tokens=BATCH_TOKENS, temperature=0.0, ignore_eos=True)
    quick = SamplingParams(max_tokens=INTERACTIVE_TOKENS, temperature=0.0, ignore_eos=True)
    batch = [JobSpec(id=f"batch-{i}", prompt=f"batch job {i}", params=batch_params, lane=Lane.BATCH)
             for i in range(SLOTS)]
    chats = [JobSpec(id=f"chat-{i}", prompt=f"question {i}", params=quick, lane=Lane.INTERACTIVE) for i in range(3)]
    client = aioredis.Redis.from_url(redis_url)
    busy_engine = Engine(model=model, max_num_seqs=SLOTS, policy="priority")
    async with running_worker(redis_url, busy_engine, worker_name="busy") as busy:
        for spec in batch:
            await xadd_job(client, spec)
        await wait_until(lambda: busy.job_loop.free == 0, "the batch jobs filling the busy worker")
        # A long blocking read: the idle worker is seldom between two reads when a chat arrives.
        async with running_worker(redis_url, Engine(model=model, max_num_seqs=SLOTS, policy="priority"),
                                  worker_name="idle", read_block_ms=1000):
            for spec in chats:
                # The claim is about an idle worker blocked on the lanes: the entry arrives once it is back in
                # its blocking read (after the last chat's commit).
                await wait_until(lambda: _blocked_on_the_lanes(client), "the idle worker blocked on the lanes")
                await xadd_job(client, spec)
                chat_views = await wait_terminal(client, [spec.id])
                assert busy.job_loop.free == 0, "a batch job ended during the chats: the busy worker was not busy"
                assert chat_views[spec.id]["worker"] == "idle", chat_views[spec.id]
            assert busy_engine.stats().num_priority_preemptions == 0
            views = await wait_terminal(client, [s.id for s in batch])
    assert all(views[s.id]["status"] == "succeeded" and views[s.id]["worker"] == "busy" for s in batch)
    await client.aclose()
