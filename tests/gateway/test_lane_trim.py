"""An accepted job is never trimmed from its lane, however deep the lane is allowed to grow."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys
from tests.harness.gateway_server import GatewayTestServer

KEYS = Keys()
NUM_BACKLOG = 100_500
"""Entries direct producers added: past the 100,000 the lane was once trimmed to on every XADD."""


async def test_a_lane_deeper_than_100k_keeps_every_accepted_job(redis_url: str, redis: aioredis.Redis) -> None:
    lane = KEYS.lane("batch")
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, max_lane_depth={"batch": 200_000})
    async with TestClient(GatewayTestServer(init_app(config))) as client:

        async def post(i: int) -> str:
            resp = await client.post("/v1/jobs", json={"prompt": f"kept {i}", "lane": "batch"})
            assert resp.status == 202
            return str((await resp.json())["id"])

        first = await asyncio.gather(*(post(i) for i in range(50)))
        for start in range(0, NUM_BACKLOG, 10_000):
            pipe = redis.pipeline(transaction=False)
            for i in range(start, min(start + 10_000, NUM_BACKLOG)):
                pipe.xadd(lane, {"job": b'{"prompt": "backlog"}'})
            await pipe.execute()
        last = await asyncio.gather(*(post(i) for i in range(50, 100)))

    assert await redis.xlen(lane) == NUM_BACKLOG + 100
    for job_id in first + last:
        stream, entry_id = (await redis.hget(KEYS.job(job_id), "stream_entry")).decode().split(" ")
        assert stream == lane
        assert len(await redis.xrange(lane, entry_id, entry_id)) == 1, f"job {job_id} was trimmed from its lane"
