"""A job handed back at shutdown is taken over by a worker with a free slot at once, ahead of newer
entries of its lane, and not at that worker's next periodic reclaim (every lease_s / 4)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from tests.harness.worker_harness import KEYS, running_worker, status_of, xadd_job

LEASE_S = 600.0
"""Periodic reclaims every 150 s, and leases that never run out here: only the hand-back can move a job."""
ONE_SLOT = {"lease_s": LEASE_S, "shutdown_grace_s": 0.0, "checkpoint_tokens": 4, "max_num_seqs": 1}


@pytest.fixture
def make_engine(tiny_model: Callable[..., str]) -> Callable[..., Any]:
    from worker.engine.engine import Engine

    return lambda max_num_seqs=1: Engine(model=tiny_model(), max_num_seqs=max_num_seqs)


def _long(job_id: str) -> JobSpec:
    return JobSpec(id=job_id, prompt="keep going", params=SamplingParams(max_tokens=1900, ignore_eos=True))


async def _until(predicate: Callable[[], Any], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def _worker_of(client: aioredis.Redis, job_id: str) -> str | None:
    raw = await client.hget(KEYS.job(job_id), "worker")
    return None if raw is None else raw.decode()


async def _attempts(client: aioredis.Redis, job_id: str) -> int:
    return int(await client.hget(KEYS.job(job_id), "attempts") or 0)


async def test_a_handed_back_job_goes_to_an_idle_worker_at_once(redis_url: str, make_engine: Callable[[], Any]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    a: Any = running_worker(redis_url, make_engine(), worker_name="a", **ONE_SLOT)
    await a.__aenter__()
    try:
        await xadd_job(client, _long("handed"))
        await _until(lambda: client.hget(KEYS.job("handed"), "checkpoint"), "a never ran the job")
        async with running_worker(redis_url, make_engine(), worker_name="b", **ONE_SLOT):
            await asyncio.sleep(0.5)  # b is past its start-up reclaim, idle on the lanes
            assert await _worker_of(client, "handed") == "a"
            a, stopping = None, a
            await stopping.__aexit__(None, None, None)  # a shuts down and hands the job back
            await _until(lambda: _attempts_at_least(client, "handed", 2), "the job was not taken over", 60)
            assert await _worker_of(client, "handed") == "b"
    finally:
        if a is not None:
            await a.__aexit__(None, None, None)
        await client.aclose()


async def test_handed_back_jobs_go_before_newer_entries(redis_url: str, make_engine: Callable[[], Any]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    a: Any = running_worker(redis_url, make_engine(), worker_name="a", **ONE_SLOT)
    await a.__aenter__()
    try:
        await xadd_job(client, _long("older"))
        await _until(lambda: client.hget(KEYS.job("older"), "checkpoint"), "a never ran the older job")
        async with running_worker(redis_url, make_engine(), worker_name="b", **ONE_SLOT):
            await xadd_job(client, JobSpec(id="busy", prompt="x", params=SamplingParams(max_tokens=300, ignore_eos=True)))
            await _until(lambda: client.hget(KEYS.job("busy"), "checkpoint"), "b never ran its job")
            await xadd_job(client, _long("newer"))  # both workers are busy: it waits in the lane
            assert await _worker_of(client, "older") == "a" and await _worker_of(client, "busy") == "b"
            a, stopping = None, a
            await stopping.__aexit__(None, None, None)  # a hands the older job back while b is still busy
            await _until(lambda: _attempts_at_least(client, "older", 2), "the older job was not taken over", 120)
            assert await _worker_of(client, "older") == "b"
            assert await status_of(client, "newer") is None  # XADDed straight: no record until a worker reads it
    finally:
        if a is not None:
            await a.__aexit__(None, None, None)
        await client.aclose()


async def test_every_handed_back_job_goes_before_newer_entries_as_slots_free(redis_url: str,
                                                                             make_engine: Callable[..., Any]) -> None:
    """More jobs handed back than the taker has free slots: each slot that frees takes the next handed-back job,
    not a newer entry, until none is left (not one at the hand-back and the rest at the periodic reclaim)."""
    client = aioredis.Redis.from_url(redis_url)
    two_slots = {**ONE_SLOT, "max_num_seqs": 2}
    a: Any = running_worker(redis_url, make_engine(2), worker_name="a", **two_slots)
    await a.__aenter__()
    shorter = SamplingParams(max_tokens=300, ignore_eos=True)
    try:
        for job_id in ("older-1", "older-2"):
            await xadd_job(client, JobSpec(id=job_id, prompt="keep going", params=shorter))
        for job_id in ("older-1", "older-2"):
            await _until(lambda job_id=job_id: client.hget(KEYS.job(job_id), "checkpoint"), f"a never ran {job_id}")
        async with running_worker(redis_url, make_engine(), worker_name="b", **ONE_SLOT):
            await xadd_job(client, JobSpec(id="busy", prompt="x", params=SamplingParams(max_tokens=100, ignore_eos=True)))
            await _until(lambda: client.hget(KEYS.job("busy"), "checkpoint"), "b never ran its job")
            await xadd_job(client, JobSpec(id="newer", prompt="x", params=shorter))  # waits in the lane
            a, stopping = None, a
            await stopping.__aexit__(None, None, None)  # a hands both back while b is busy
            for job_id in ("older-1", "older-2"):
                await _until(lambda job_id=job_id: _attempts_at_least(client, job_id, 2), f"{job_id} not taken over",
                             120)
            assert await status_of(client, "newer") is None  # not read while a handed-back job waited
    finally:
        if a is not None:
            await a.__aexit__(None, None, None)
        await client.aclose()


async def _attempts_at_least(client: aioredis.Redis, job_id: str, n: int) -> bool:
    return await _attempts(client, job_id) >= n
