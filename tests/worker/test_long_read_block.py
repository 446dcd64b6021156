"""A worker whose idle reads block longer than a Redis reply may take (`--read-block-ms` past
`--redis-timeout-s`): an idle read that ends empty is no outage, and jobs still run."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from tests.harness.worker_harness import KEYS, start_worker_process, wait_terminal, wait_until, xadd_job


async def test_idle_reads_longer_than_the_redis_timeout_are_not_an_outage(redis_url, tiny_model, tmp_path) -> None:
    client = aioredis.Redis.from_url(redis_url)
    log_path = tmp_path / "worker.log"
    timeout_s = 2
    block_ms = (timeout_s + 2) * 1000
    proc = start_worker_process(redis_url, tiny_model(), "patient", log_path, "--read-block-ms", str(block_ms),
                                "--redis-timeout-s", str(timeout_s))
    try:
        await wait_until(lambda: client.hexists(KEYS.workers, "patient"), "the worker's first heartbeat")
        # An idle read that blocks past the Redis timeout, and most of the next: a socket timeout that left out
        # the block would have ended the first one 2 s before its end.
        await asyncio.sleep(1.5 * block_ms / 1000)
        await xadd_job(client, JobSpec(id="after-idle", prompt="hello", params=SamplingParams(max_tokens=3)))
        views = await wait_terminal(client, ["after-idle"])
    finally:
        proc.terminate()
        proc.wait()
        await client.aclose()
    assert views["after-idle"]["status"] == "succeeded"
    assert "Redis unavailable" not in log_path.read_text(errors="replace")
