"""Worker telemetry for jobs that never reach the engine: dead-lettered jobs are finished jobs too."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.job import JobSpec
from scheduler.keys import CONSUMER_GROUP
from scheduler.lanes import LANES, Lane
from scheduler.params import SamplingParams
from telemetry_support import value
from worker_harness import KEYS, running_worker, wait_terminal, xadd_job


@pytest.fixture
def engine(tiny_model):
    from worker.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


async def crashed_worker_holds(client: aioredis.Redis, spec: JobSpec) -> None:
    """Put a job on its lane as read by a worker that then died: pending, never renewed."""
    for lane in LANES:
        await client.xgroup_create(KEYS.lane(lane), CONSUMER_GROUP, id="0", mkstream=True)
    await xadd_job(client, spec)
    read = await client.xreadgroup(CONSUMER_GROUP, "crashed-worker", {KEYS.lane(spec.lane): ">"}, count=1)
    assert len(read[0][1]) == 1


async def test_dead_lettered_jobs_count_as_failed_jobs(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    # Delivered once to the crashed worker; the reclaim is its second delivery, past max_deliveries=1.
    await crashed_worker_holds(client, JobSpec(id="redelivered", prompt="too often", params=params))
    async with running_worker(redis_url, engine, max_deliveries=1, lease_s=0.3) as worker:
        await client.xadd(KEYS.lane(Lane.BATCH), {"job": msgpack.packb(
            {"v": 1, "id": "poison", "prompt": "hi", "params": {"temperature": -1}})})
        await xadd_job(client, JobSpec(id="good", prompt="fine", params=params))
        views = await wait_terminal(client, ["redelivered", "poison", "good"], timeout_s=60)
        deadline = time.monotonic() + 10
        while await client.xlen(KEYS.dead) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        text = worker.metrics.render().decode()
    await client.aclose()
    assert {job_id: v["status"] for job_id, v in views.items()} == {
        "redelivered": "failed", "poison": "failed", "good": "succeeded"}
    assert views["redelivered"]["error"]["type"] == "too_many_deliveries"
    assert value(text, "carpool_jobs_dead_lettered_total", carpool_dead_letter_reason="too_many_deliveries",
                 carpool_lane="standard") == 1
    assert value(text, "carpool_jobs_dead_lettered_total", carpool_dead_letter_reason="invalid_job",
                 carpool_lane="batch") == 1
    # both dead-lettered jobs are finished jobs, on their own lane, with an end-to-end latency
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="failed") == 2
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="failed", carpool_lane="standard") == 1
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="failed", carpool_lane="batch") == 1
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="succeeded") == 1
    assert value(text, "gen_ai_server_request_duration_seconds_count", carpool_job_status="failed") == 2
