"""An `Idempotency-Key` is never left pointing at a job that does not exist, whatever fails mid-submission."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys
from scheduler.protocol.tenants import DEFAULT_TENANT
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.redis_proxy import RedisProxy

KEYS = Keys()


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[RedisProxy]:
    proxy = await RedisProxy(redis_url).start()
    yield proxy
    await proxy.aclose()


async def test_redis_lost_right_after_the_key_is_written_leaves_the_key_usable(
    proxy: RedisProxy, redis: aioredis.Redis
) -> None:
    config = GatewayConfig(redis_url=proxy.url, no_webhooks=True, redis_pool_timeout_s=1)
    headers = {"Idempotency-Key": "order-42"}
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        proxy.trip(b"idem:order-42")  # the first command naming the key reaches Redis; then Redis is gone
        resp = await client.post("/v1/jobs", json={"prompt": "hello"}, headers=headers)
        assert proxy.num_tripped == 1
        assert resp.status == 503, await resp.text()

        proxy.restore()
        resp = await client.post("/v1/jobs", json={"prompt": "hello"}, headers=headers)
        first = await resp.json()
        assert resp.status in (200, 202), first  # never 409 "still creating"
        again = await client.post("/v1/jobs", json={"prompt": "hello"}, headers=headers)
        assert (again.status, (await again.json())["id"]) == (200, first["id"])

        view = await (await client.get(f"/v1/jobs/{first['id']}")).json()
        assert view["status"] == "queued"
    assert await redis.get(KEYS.idempotency(DEFAULT_TENANT, "order-42")) == first["id"].encode()
    assert await redis.xlen(KEYS.lane("standard")) == 1


async def test_a_key_naming_a_job_that_no_longer_exists_is_taken_over(redis_url: str, redis: aioredis.Redis) -> None:
    await redis.set(KEYS.idempotency(DEFAULT_TENANT, "order-7"), "job_that_never_was", ex=86400)
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        resp = await client.post("/v1/jobs", json={"prompt": "hello"}, headers={"Idempotency-Key": "order-7"})
        reply = await resp.json()
        assert resp.status == 202, reply
    assert await redis.get(KEYS.idempotency(DEFAULT_TENANT, "order-7")) == reply["id"].encode()
    assert await redis.xlen(KEYS.lane("standard")) == 1
