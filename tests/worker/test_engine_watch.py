"""A worker whose engine hangs or dies stops (exit status 1, its jobs going on elsewhere from their checkpoints)
rather than hold its jobs while looking healthy; an idle worker finds a dead engine process too."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from tests.harness.worker_harness import KEYS, HeldReplies, has_status, running_worker, wait_until, xadd_job


@pytest.fixture
def engine(tiny_model) -> Any:
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(max_position_embeddings=16384), max_num_seqs=2)


async def test_an_engine_that_answers_no_step_is_taken_as_hung(redis_url: str, engine: Any, caplog) -> None:
    runner = HeldReplies(engine)
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=16000, temperature=0, ignore_eos=True)
    with caplog.at_level("INFO"):
        async with running_worker(redis_url, runner, engine_stall_s=0.5, checkpoint_tokens=4) as service:
            await xadd_job(client, JobSpec(id="stalled", prompt="x", params=params))
            await wait_until(lambda: client.hget(KEYS.job("stalled"), "checkpoint"), "the job running")
            await runner.hold()  # the engine answers nothing more: hung
            await wait_until(lambda: service.stopped.is_set(), "the worker stopping")
            assert service.has_failed
        await runner.release()
    await client.aclose()
    # Still hung through the shutdown: its aborts unanswered, the job was handed back all the same.
    assert any(r.getMessage() == "handed back 1 unfinished jobs with their checkpoints" for r in caplog.records)
    failures = [str(r.exc_info[1]) for r in caplog.records if r.exc_info]
    assert any("answered no step for 0.5s (--engine-stall-s)" in failure for failure in failures), failures
    assert any("did not answer the aborts" in r.getMessage() for r in caplog.records)
    assert service.has_failed  # kept after the shutdown: the process exits 1


async def test_an_idle_worker_whose_engine_process_died_stops(redis_url: str, engine: Any) -> None:
    from worker.engine.wire import EngineFailed

    runner = HeldReplies(engine)
    client = aioredis.Redis.from_url(redis_url)
    async with running_worker(redis_url, runner) as service:
        await xadd_job(client, JobSpec(id="before", prompt="x", params=SamplingParams(max_tokens=2)))
        await wait_until(lambda: has_status(client, "before", "succeeded"), "a job done: the worker idle")
        # As `EngineProcess` finds it when its process dies with no tick out.
        runner.failure = EngineFailed("the engine process (pid 1) exited with code -9")
        await wait_until(lambda: service.stopped.is_set(), "the worker stopping")
        assert service.has_failed
    await client.aclose()
