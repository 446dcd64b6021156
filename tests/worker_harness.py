"""Helpers for the worker tests: a worker running in the test's event loop, direct XADDs, waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from scheduler.job import TERMINAL_STATUSES, JobSpec
from scheduler.job_record import job_view
from scheduler.keys import Keys

KEYS = Keys()
TERMINAL = {s.value for s in TERMINAL_STATUSES}


async def xadd_job(client: aioredis.Redis, spec: JobSpec) -> str:
    entry_id = await client.xadd(KEYS.lane(spec.lane), {"job": spec.pack()})
    return entry_id.decode()


async def status_of(client: aioredis.Redis, job_id: str) -> str | None:
    raw = await client.hget(KEYS.job(job_id), "status")
    return None if raw is None else raw.decode()


async def wait_terminal(client: aioredis.Redis, ids: Iterable[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every job's public view once all are terminal; fails the test on timeout."""
    pending = list(ids)
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = [await status_of(client, i) for i in pending]
        if all(s in TERMINAL for s in statuses):
            return {i: job_view(await client.hgetall(KEYS.job(i))) for i in pending}
        if time.monotonic() > deadline:
            left = {i: s for i, s in zip(pending, statuses) if s not in TERMINAL}
            raise AssertionError(f"{len(left)} jobs not finished in {timeout_s}s: {dict(list(left.items())[:5])}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def running_worker(redis_url: str, engine: Any, **overrides: Any) -> AsyncIterator[Any]:
    """A WorkerService on `engine` inside this event loop; shut down (two phases) on exit."""
    from worker.config import WorkerConfig
    from worker.service import WorkerService

    settings: dict[str, Any] = {"redis_url": redis_url, "metrics_port": 0, "max_wait_ms": 5.0,
                                "max_num_seqs": engine.max_num_seqs, "shutdown_grace_s": 5.0}
    settings.update(overrides)
    config = WorkerConfig(**settings)
    client = aioredis.Redis.from_url(redis_url)
    service = WorkerService(config, engine, client)
    await service.start()
    try:
        yield service
    finally:
        await service.shutdown()
        await client.aclose()
