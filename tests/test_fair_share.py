"""Fair share inside a lane, end to end: a real gateway with keys, real worker processes, a real Redis.

Tenant A floods the batch lane, then tenant B queues a few jobs: B's jobs are served alongside A's instead of
behind all of them, and A's keep finishing. A worker SIGKILLed meanwhile loses nothing: every job of both
tenants finishes exactly once. The full-size measurement is ``carpool bench --workload fair-share``.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.api_keys import KeyStore
from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.lanes import Lane
from scheduler.tenants import TenantLimits
from worker_harness import KEYS, start_worker_process, wait_terminal, wait_until

NUM_A = 60
NUM_B = 6
SLOTS = 2


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[tuple[str, dict[str, str], dict[str, str]]]:
    """(gateway URL, A's auth header, B's auth header): keys on, a worker-free gateway over the session's Redis."""
    server = TestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, api_keys=True)),
                        host="127.0.0.1")
    await server.start_server()
    client = aioredis.Redis.from_url(redis_url)
    store = KeyStore(client, KEYS)
    key_a, _ = await store.create("flood", TenantLimits())
    key_b, _ = await store.create("small", TenantLimits())
    yield (str(server.make_url("")).rstrip("/"), {"Authorization": f"Bearer {key_a}"},
           {"Authorization": f"Bearer {key_b}"})
    await client.aclose()
    await server.close()


async def _queue(http: ClientSession, url: str, headers: dict[str, str], prefix: str, n: int,
                 max_tokens: int) -> list[str]:
    ids = []
    for i in range(n):
        body = {"id": f"{prefix}-{i}", "prompt": f"{prefix} prompt {i}", "lane": "batch", "reply_to": "replies:fair",
                "params": {"max_tokens": max_tokens, "ignore_eos": True}}
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202, await resp.text()
        ids.append(body["id"])
    return ids


async def _count(client: aioredis.Redis, ids: list[str], field: str) -> int:
    async with client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hexists(KEYS.job(job_id), field)
        return sum(bool(x) for x in await pipe.execute())


async def _started_at(client: aioredis.Redis, ids: list[str]) -> list[float]:
    """When each job that has started did (unix s, the workers' clock)."""
    async with client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(KEYS.job(job_id), "started_at")
        return [float(x) for x in await pipe.execute() if x is not None]


def _stop(*procs: subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


async def test_a_small_tenant_is_served_beside_a_flooding_one_not_behind_it(stack, redis_url, tiny_model,
                                                                             tmp_path: Path) -> None:
    url, a, b = stack
    client = aioredis.Redis.from_url(redis_url)
    worker = start_worker_process(redis_url, tiny_model(), "fair", tmp_path / "fair.log", "--max-num-seqs", str(SLOTS))
    try:
        async with ClientSession() as http:
            a_ids = await _queue(http, url, a, "a", NUM_A, max_tokens=4)
            await wait_until(lambda: _count(client, a_ids, "finished_at"), "the worker finishing A's first jobs")
            a_started_before_b = await _count(client, a_ids, "started_at")
            a_done_before_b = await _count(client, a_ids, "finished_at")
            b_ids = await _queue(http, url, b, "b", NUM_B, max_tokens=4)
        await wait_terminal(client, b_ids)
        a_done_when_b_done = await _count(client, a_ids, "finished_at")
        last_b_start = max(await _started_at(client, b_ids))
        a_started_before_last_b = sum(s <= last_b_start for s in await _started_at(client, a_ids))
        # Served in turns: while B had work, A got about one start per B start (plus what filled the slots and
        # was read as B arrived), not the ~NUM_A - a_started_before_b of first-come-first-served.
        assert a_started_before_last_b - a_started_before_b <= NUM_B + 2 * SLOTS + 2, (
            a_started_before_b, a_started_before_last_b)
        assert a_done_when_b_done < NUM_A // 2
        assert a_done_when_b_done > a_done_before_b  # and A's jobs kept finishing meanwhile
        views = await wait_terminal(client, a_ids)
        assert all(v["status"] == "succeeded" for v in views.values())
    finally:
        _stop(worker)
        await client.aclose()


async def test_a_worker_sigkilled_during_fair_share_loses_nothing_and_every_job_finishes_once(
        stack, redis_url, tiny_model, tmp_path: Path) -> None:
    url, a, b = stack
    client = aioredis.Redis.from_url(redis_url)
    model = tiny_model()
    doomed = start_worker_process(redis_url, model, "doomed", tmp_path / "doomed.log")
    rescuer = None
    try:
        async with ClientSession() as http:
            # Long enough that the doomed worker is mid-generation on several jobs when it is killed.
            a_ids = await _queue(http, url, a, "a", 60, max_tokens=48)
            b_ids = await _queue(http, url, b, "b", 20, max_tokens=48)

        async def mid_generation() -> bool:  # several jobs checkpointed and unfinished, some already done
            assert doomed.poll() is None, (tmp_path / "doomed.log").read_text()
            async with client.pipeline(transaction=False) as pipe:
                for job_id in a_ids + b_ids:
                    pipe.hmget(KEYS.job(job_id), ["status", "checkpoint"])
                records = await pipe.execute()
            mid = sum(1 for status, ckpt in records if status == b"running" and ckpt)
            done = sum(1 for status, _ in records if status == b"succeeded")
            return mid >= 4 and done >= 2

        await wait_until(mid_generation, "jobs of both tenants mid-generation on the doomed worker")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        rescuer = start_worker_process(redis_url, model, "rescuer", tmp_path / "rescuer.log")
        views = await wait_terminal(client, a_ids + b_ids)
        await wait_until(lambda: _no_active(client), "both tenants retired from the batch lane")
    finally:
        _stop(doomed, rescuer)
    assert all(v["status"] == "succeeded" for v in views.values()), [v for v in views.values()
                                                                      if v["status"] != "succeeded"][:3]
    assert all(len(v["output"]["token_ids"]) == 48 for v in views.values())
    replies = [msgpack.unpackb(f[b"result"], raw=False)["id"] for _, f in await client.xrange("replies:fair")]
    assert sorted(replies) == sorted(a_ids + b_ids)  # every job finished exactly once
    assert any(v["worker"] == "rescuer" and v["attempts"] == 2 for v in views.values())  # some were taken over
    for tenant in ("flood", "small"):  # nothing left behind in the tenants' streams
        assert await client.xlen(KEYS.tenant_lane(Lane.BATCH, tenant)) == 0
    await client.aclose()


async def _no_active(client: aioredis.Redis) -> bool:
    return await client.scard(KEYS.lane_tenants(Lane.BATCH)) == 0
