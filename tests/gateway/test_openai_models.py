"""GET /v1/models: the models live workers serve, each `created` when its first worker started."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys

KEYS = Keys()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, model_heartbeat_max_age_s=5.0)
    async with TestClient(TestServer(init_app(config))) as client:
        yield client


async def _beat(redis: aioredis.Redis, worker: str, model: str, started: float) -> None:
    await redis.hset(KEYS.workers, worker, msgpack.packb({"time": time.time(), "started": started, "model": model,
                                                          "running": 0, "capacity": 8}))


async def test_created_is_the_first_workers_start_and_stays_across_heartbeats(client: TestClient,
                                                                             redis: aioredis.Redis) -> None:
    await _beat(redis, "w1", "llama", started=1_700_000_100.0)
    await _beat(redis, "w2", "llama", started=1_700_000_000.0)
    await _beat(redis, "w3", "qwen", started=1_700_000_500.0)
    listed = await (await client.get("/v1/models")).json()
    assert [(m["id"], m["created"]) for m in listed["data"]] == [("llama", 1_700_000_000), ("qwen", 1_700_000_500)]
    for _ in range(2):  # heartbeats later: the same answer
        await _beat(redis, "w1", "llama", started=1_700_000_100.0)
        await _beat(redis, "w2", "llama", started=1_700_000_000.0)
        assert (await (await client.get("/v1/models/llama")).json())["created"] == 1_700_000_000
