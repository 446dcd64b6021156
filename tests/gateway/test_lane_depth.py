"""`--max-lane-depth` holds under concurrent requests: the depth is counted in the script that adds the entry."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import redis.asyncio as aioredis
from aiohttp import ClientSession, TCPConnector

from gateway.api_keys import KeyStore
from scheduler.protocol.keys import Keys
from scheduler.protocol.tenants import TenantLimits
from tests.harness.openai_support import gateway_server

KEYS = Keys()
MAX_DEPTH = 5
NUM_REQUESTS = 300


def _gateway(redis_url: str, **settings: Any) -> AbstractAsyncContextManager[str]:
    """A gateway (no worker) on a free 127.0.0.1 port whose lanes hold MAX_DEPTH jobs; yields its base URL."""
    return gateway_server(redis_url, max_lane_depth={"standard": MAX_DEPTH, "batch": MAX_DEPTH}, retry_after_s=3,
                          **settings)


async def _post_jobs(url: str, auths: list[str | None]) -> list[tuple[int, str | None, str]]:
    """One `POST /v1/jobs` into the batch lane per entry of `auths` (a key, or None), all at once:
    (status, Retry-After, error type or '')."""
    async with ClientSession(connector=TCPConnector(limit=0)) as http:

        async def post(i: int, auth: str | None) -> tuple[int, str | None, str]:
            headers = {} if auth is None else {"Authorization": f"Bearer {auth}"}
            async with http.post(f"{url}/v1/jobs", json={"prompt": f"job {i}", "lane": "batch"}, headers=headers) as r:
                body = await r.json()
                return r.status, r.headers.get("Retry-After"), body.get("error", {}).get("type", "")

        return await asyncio.gather(*(post(i, auth) for i, auth in enumerate(auths)))


async def _lane_jobs(redis: aioredis.Redis, lane: str) -> int:
    """Entries in the lane stream and in every tenant stream of the lane."""
    streams = [KEYS.lane(lane)] + [k.decode() async for k in redis.scan_iter(match=f"{KEYS.tenant_lane_prefix(lane)}*")]
    return sum([await redis.xlen(stream) for stream in streams])


async def test_concurrent_submissions_fill_a_lane_to_its_depth_and_no_further(redis_url: str,
                                                                               redis: aioredis.Redis) -> None:
    async with _gateway(redis_url) as url:
        answers = await _post_jobs(url, [None] * NUM_REQUESTS)
        async with ClientSession() as http, http.get(f"{url}/readyz") as resp:
            ready = await resp.json()
    assert sum(status == 202 for status, _, _ in answers) == MAX_DEPTH
    assert sorted({a for a in answers if a[0] != 202}) == [(429, "3", "lane_full")]
    assert await redis.xlen(KEYS.lane("batch")) == MAX_DEPTH
    assert ready["lanes"]["batch"]["depth"] == MAX_DEPTH


async def test_tenants_submitting_at_once_share_the_lane_depth(redis_url: str, redis: aioredis.Redis) -> None:
    store = KeyStore(redis, KEYS)
    keys = [(await store.create(f"tenant-{t}", TenantLimits()))[0] for t in "abc"]
    async with _gateway(redis_url, api_keys=True) as url:
        answers = await _post_jobs(url, [keys[i % len(keys)] for i in range(NUM_REQUESTS)])
    assert sum(status == 202 for status, _, _ in answers) == MAX_DEPTH
    assert sorted({a for a in answers if a[0] != 202}) == [(429, "3", "lane_full")]
    assert await _lane_jobs(redis, "batch") == MAX_DEPTH


async def test_concurrent_requests_for_two_choices_are_admitted_whole_within_the_depth(
        redis_url: str, redis: aioredis.Redis) -> None:
    """No worker: an admitted request waits for its choices, a refused one is answered at once. A few requests at
    a time, in rounds, each round's admitted jobs then cancelled (which answers their requests) to empty the lane."""
    rounds = [3, 4, 5, 6] * 5  # requests at once
    async with _gateway(redis_url) as url, ClientSession(connector=TCPConnector(limit=0)) as http:

        async def complete(i: int) -> tuple[int, str | None, str]:
            body = {"model": "any", "prompt": f"request {i}", "max_tokens": 2, "n": 2}
            async with http.post(f"{url}/v1/completions", json=body) as r:
                error = (await r.json()).get("error", {})
                return r.status, r.headers.get("Retry-After"), error.get("code", "")

        async def admitted() -> dict[str, list[str]]:
            """The choices waiting in the lane, by request id, of the requests none of whose choices is cancelled."""
            statuses: dict[str, list[str]] = {}
            async for key in redis.scan_iter(match=KEYS.job("cmpl-*")):
                job_id = key.decode().removeprefix(KEYS.job(""))
                statuses.setdefault(job_id.rsplit("-", 1)[0], []).append((await redis.hget(key, "status")).decode())
            return {r: s for r, s in statuses.items() if "cancelled" not in s}

        for num_requests in rounds:
            calls = [asyncio.create_task(complete(i)) for i in range(num_requests)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until every request is refused or has both choices waiting
                waiting = await admitted()
                if sum(c.done() for c in calls) + sum(s == ["queued"] * 2 for s in waiting.values()) == num_requests:
                    break
                await asyncio.sleep(0.05)
            refused = [c.result() for c in calls if c.done()]
            assert waiting and all(s == ["queued"] * 2 for s in waiting.values()), waiting
            assert 2 * len(waiting) <= MAX_DEPTH, waiting
            assert len(refused) + len(waiting) == num_requests
            assert set(refused) == {(429, "3", "lane_full")}
            for request_id in waiting:
                for job_id in (f"{request_id}-0", f"{request_id}-1"):
                    async with http.delete(f"{url}/v1/jobs/{job_id}") as resp:
                        assert resp.status == 202
            await asyncio.gather(*calls)
            assert await redis.xlen(KEYS.lane("standard")) == 0
