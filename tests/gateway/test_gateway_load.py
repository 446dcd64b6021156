"""A real gateway process under hundreds of concurrent requests: no 5xx, no error logs.

The full-size measurement (2,000 waiters, 1,000 POSTs) is `bench/gateway_load.py`;
this keeps a smaller load, still past the size of redis-py's default pool (100),
within the test suite's time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import redis.asyncio as aioredis

from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import Keys
from tests.harness.gateway_process import gateway_process, raise_fd_limit

KEYS = Keys()
NUM_CONCURRENT = 300
NUM_ABANDONED_STREAMS = 40


async def body_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    text = await resp.text()
    try:
        return dict(json.loads(text))
    except ValueError:
        return {"not_json": text[:200]}


async def post_job(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}/v1/jobs", json={"prompt": f"load {i}", "params": {"max_tokens": 4}}) as resp:
        return resp.status, await body_of(resp)


async def long_poll(http: aiohttp.ClientSession, url: str, job_id: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/v1/jobs/{job_id}?wait=60") as resp:
        return resp.status, await body_of(resp)


async def read_events(http: aiohttp.ClientSession, url: str, job_id: str) -> tuple[int, list[str]]:
    """The status and the event names of one whole event stream."""
    async with http.get(f"{url}/v1/jobs/{job_id}/events") as resp:
        if resp.status != 200:
            return resp.status, []
        events = []
        async for line in resp.content:
            if line.startswith(b"event: "):
                events.append(line[len(b"event: "):].strip().decode())
                if events[-1] == "final":
                    break
        return resp.status, events


async def abandon_events(http: aiohttp.ClientSession, url: str, job_id: str) -> int:
    """Open an event stream, read its first keep-alive, then hang up."""
    async with http.get(f"{url}/v1/jobs/{job_id}/events") as resp:
        await resp.content.readline()
        resp.close()
        return resp.status


async def open_waiters(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("carpool_gateway_open_waiters") and not line.startswith("#"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def finish_all(redis: aioredis.Redis, ids: list[str]) -> None:
    """What workers do at the end of each job: write the result, then publish the final event."""
    now = time.time()
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hset(KEYS.job(job_id), mapping={
            "status": "succeeded", "started_at": repr(now), "finished_at": repr(now), "worker": "w-load",
            "output": msgpack.packb({"text": "ok", "token_ids": [1], "finish_reason": "length"}),
        })
    await pipe.execute()
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        view = job_view(await redis.hgetall(KEYS.job(job_id)))
        pipe.publish(KEYS.events(job_id), msgpack.packb({"type": "final", "id": job_id, "job": view}))
    await pipe.execute()


def error_lines(log_text: str) -> list[str]:
    bad = []
    for line in log_text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                bad.append(line)
            continue
        if isinstance(record, dict) and record.get("level") in ("error", "critical"):
            bad.append(line)
    return bad


async def test_hundreds_of_concurrent_posts_long_polls_and_streams_get_no_5xx(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    raise_fd_limit(8 * NUM_CONCURRENT + 1024)
    with gateway_process(redis_url, tmp_path / "gateway.log", "--sse-heartbeat-s", "0.5") as gateway:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
            posted = await asyncio.gather(*(post_job(http, gateway.url, i) for i in range(NUM_CONCURRENT)))
            assert Counter(status for status, _ in posted) == {202: NUM_CONCURRENT}, [b for s, b in posted if s != 202][:3]
            ids = [body["id"] for _, body in posted]

            polls = [asyncio.create_task(long_poll(http, gateway.url, job_id)) for job_id in ids]
            streams = [asyncio.create_task(read_events(http, gateway.url, job_id)) for job_id in ids]
            abandoned = await asyncio.gather(*(abandon_events(http, gateway.url, job_id)
                                               for job_id in ids[:NUM_ABANDONED_STREAMS]))
            deadline = time.monotonic() + 60
            while await open_waiters(http, gateway.url) < 2 * NUM_CONCURRENT:
                assert not any(t.done() for t in polls + streams), "a waiter answered before its job finished"
                assert time.monotonic() < deadline, "the waiters never all opened"
                await asyncio.sleep(0.2)
            await finish_all(redis, ids)
            poll_results = await asyncio.gather(*polls)
            stream_results = await asyncio.gather(*streams)

    assert abandoned == [200] * NUM_ABANDONED_STREAMS
    assert Counter(status for status, _ in poll_results) == {200: NUM_CONCURRENT}
    assert Counter(view["status"] for _, view in poll_results) == {"succeeded": NUM_CONCURRENT}
    assert Counter(status for status, _ in stream_results) == {200: NUM_CONCURRENT}
    assert all(events and events[-1] == "final" for _, events in stream_results)
    assert error_lines(gateway.log_text()) == []


async def test_no_free_redis_connection_is_a_json_503_with_retry_after(redis_url: str, redis: aioredis.Redis) -> None:
    from aiohttp.test_utils import TestClient
    from tests.harness.gateway_server import GatewayTestServer

    from gateway import appkeys
    from gateway.app import init_app
    from gateway.config import GatewayConfig

    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, redis_max_connections=1,
                           redis_pool_timeout_s=0.2, retry_after_s=3)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        assert (await client.post("/v1/jobs", json={"prompt": "before"})).status == 202
        pool = client.app[appkeys.REDIS].connection_pool
        held = await pool.get_connection()  # every pooled connection is busy
        try:
            resp = await client.post("/v1/jobs", json={"prompt": "during"})
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "3"
            error = (await resp.json())["error"]
            assert error["type"] == "unavailable"
            assert "pooled Redis connections stayed busy" in error["message"], error  # Redis itself is fine
        finally:
            await pool.release(held)
        assert (await client.post("/v1/jobs", json={"prompt": "after"})).status == 202
    assert await redis.xlen(KEYS.lane("standard")) == 2
