"""Fair share inside a lane, end to end: a real gateway with keys, real worker processes, a real Redis.

Tenant A floods the batch lane, then tenant B queues a few jobs: B's jobs are served alongside A's instead of
behind all of them, and A's keep finishing. A worker SIGKILLed meanwhile loses nothing: every job of both
tenants finishes exactly once. The full-size measurement is ``carpool bench --workload fair-share``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession

from gateway.api_keys import KeyStore
from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.lanes import Lane
from scheduler.protocol.tenants import TenantLimits
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import KEYS, kill_holding, start_worker_process, wait_terminal, wait_until

NUM_A = 60
NUM_B = 6
SLOTS = 2


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[tuple[str, dict[str, str], dict[str, str]]]:
    """(gateway URL, A's auth header, B's auth header): keys on, a worker-free gateway over the session's Redis."""
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, api_keys=True)),
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


REPLIES = {"a": "flood:replies", "b": "small:replies"}
"""Each tenant's reply stream, by job id prefix: a tenant's is under its own name."""

async def _queue(http: ClientSession, url: str, headers: dict[str, str], prefix: str, n: int,
                 max_tokens: int) -> list[str]:
    """Submit `n` batch jobs at once (concurrent requests), as one producer's burst, replying to the tenant's
    stream (tenant `flood` for prefix a, `small` for b)."""
    async def one(i: int) -> str:
        body = {"id": f"{prefix}-{i}", "prompt": f"{prefix} prompt {i}", "lane": "batch", "reply_to": REPLIES[prefix],
                "params": {"max_tokens": max_tokens, "ignore_eos": True}}
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202, await resp.text()
        return body["id"]

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _count(client: aioredis.Redis, ids: list[str], field: str) -> int:
    async with client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hexists(KEYS.job(job_id), field)
        return sum(bool(x) for x in await pipe.execute())


async def _times(client: aioredis.Redis, ids: list[str], field: str) -> list[float]:
    """The record's `field` (unix s) of each job that has one; gateway and workers share this machine's clock."""
    async with client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(KEYS.job(job_id), field)
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
            b_ids = await _queue(http, url, b, "b", NUM_B, max_tokens=4)
        b_views = await wait_terminal(client, b_ids)
        b_from = min(v["created_at"] for v in b_views.values())
        b_last_start = max(v["started_at"] for v in b_views.values())
        b_last_end = max(v["finished_at"] for v in b_views.values())
        a_starts = await _times(client, a_ids, "started_at")
        a_ends = await _times(client, a_ids, "finished_at")
        # Served in turns: from B's first submission to B's last start, A got about one start per B start
        # (plus what held the slots and was read as B arrived), not the ~NUM_A of first come, first served.
        a_started_meanwhile = sum(b_from <= t <= b_last_start for t in a_starts)
        assert a_started_meanwhile <= NUM_B + 2 * SLOTS + 2, (a_started_meanwhile, len(a_starts))
        assert sum(t <= b_last_end for t in a_ends) < NUM_A // 2
        assert sum(b_from <= t <= b_last_end for t in a_ends) > 0  # and A's jobs kept finishing meanwhile
        assert all(v["status"] == "succeeded" for v in b_views.values())
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

        async def running() -> list[str]:
            async with client.pipeline(transaction=False) as pipe:
                for job_id in a_ids + b_ids:
                    pipe.hget(KEYS.job(job_id), "status")
                statuses = await pipe.execute()
            return [job_id for job_id, status in zip(a_ids + b_ids, statuses, strict=True) if status == b"running"]

        held = await kill_holding(doomed, mid_generation, running,
                                  "jobs of both tenants mid-generation on the doomed worker")
        rescuer = start_worker_process(redis_url, model, "rescuer", tmp_path / "rescuer.log")
        views = await wait_terminal(client, a_ids + b_ids)
        await wait_until(lambda: _no_active(client), "both tenants retired from the batch lane")
    finally:
        _stop(doomed, rescuer)
    assert all(v["status"] == "succeeded" for v in views.values()), [v for v in views.values()
                                                                      if v["status"] != "succeeded"][:3]
    assert all(len(v["output"]["token_ids"]) == 48 for v in views.values())
    replies = [msgpack.unpackb(f[b"result"], raw=False)["id"]
               for stream in REPLIES.values() for _, f in await client.xrange(stream)]
    assert sorted(replies) == sorted(a_ids + b_ids)  # every job finished exactly once
    # What the doomed worker held when it was killed was taken over (a commit it had already sent when it was
    # frozen may still have landed, so not necessarily every one of them).
    assert any(views[job_id]["worker"] == "rescuer" and views[job_id]["attempts"] >= 2 for job_id in held), [
        views[job_id] for job_id in held]
    for tenant in ("flood", "small"):  # nothing left behind in the tenants' streams
        assert await client.xlen(KEYS.tenant_lane(Lane.BATCH, tenant)) == 0
    await client.aclose()


async def _no_active(client: aioredis.Redis) -> bool:
    return await client.scard(KEYS.lane_tenants(Lane.BATCH)) == 0
