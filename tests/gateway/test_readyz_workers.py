"""What the gateway makes of the workers' heartbeats. /readyz shows the live workers only: a worker that died
without removing its heartbeat drops out of the list once its heartbeat is older than
--model-heartbeat-max-age-s, and its entry is removed. GET /v1/models lists the models live workers serve, each
`created` when its first worker started."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys
from tests.harness.gateway_server import GatewayTestServer

KEYS = Keys()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, model_heartbeat_max_age_s=60.0)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        yield client


async def test_a_killed_workers_old_heartbeat_is_not_shown_and_is_pruned(client: TestClient, redis: aioredis.Redis) -> None:
    now = time.time()
    await redis.hset(KEYS.workers, "alive", msgpack.packb({"time": now, "running": 1, "capacity": 8}))
    await redis.hset(KEYS.workers, "killed", msgpack.packb({"time": now - 15 * 60, "running": 3, "capacity": 8}))
    await redis.hset(KEYS.workers, "just-in-time", msgpack.packb({"time": now - 30.0, "running": 0, "capacity": 4}))
    resp = await client.get("/readyz")
    assert resp.status == 200
    ready = await resp.json()
    assert ready["status"] == "ready"
    assert set(ready["workers"]) == {"alive", "just-in-time"}
    assert ready["workers"]["alive"]["running"] == 1
    assert set(await redis.hkeys(KEYS.workers)) == {b"alive", b"just-in-time"}


async def test_entries_held_by_a_worker_no_longer_alive_count_as_waiting(client: TestClient,
                                                                          redis: aioredis.Redis) -> None:
    """A killed worker's entries wait for another worker's reclaim: /readyz counts them as waiting (what an
    autoscaler scales on), not as running, which a pool of no worker at all would otherwise show forever."""
    from scheduler.protocol.keys import CONSUMER_GROUP

    lane = KEYS.lane("batch")
    await redis.xgroup_create(lane, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(5):
        await redis.xadd(lane, {"job": msgpack.packb({"id": f"j{i}", "prompt": "x"})})
    await redis.xreadgroup(CONSUMER_GROUP, "alive", {lane: ">"}, count=2)
    await redis.xreadgroup(CONSUMER_GROUP, "killed", {lane: ">"}, count=2)  # no heartbeat: gone
    await redis.hset(KEYS.workers, "alive", msgpack.packb({"time": time.time(), "running": 2, "capacity": 8}))
    batch = (await (await client.get("/readyz")).json())["lanes"]["batch"]
    assert batch == {"depth": 5, "max_depth": batch["max_depth"], "waiting": 3, "running": 2}


async def test_a_worker_heard_from_again_is_shown_again(client: TestClient, redis: aioredis.Redis) -> None:
    await redis.hset(KEYS.workers, "w1", msgpack.packb({"time": time.time() - 120, "running": 0, "capacity": 8}))
    assert (await (await client.get("/readyz")).json())["workers"] == {}
    await redis.hset(KEYS.workers, "w1", msgpack.packb({"time": time.time(), "running": 2, "capacity": 8}))
    assert (await (await client.get("/readyz")).json())["workers"]["w1"]["running"] == 2


async def test_an_unreadable_heartbeat_is_named_and_left_alone(client: TestClient, redis: aioredis.Redis) -> None:
    await redis.hset(KEYS.workers, "future", b"\xc1 not msgpack")
    assert (await (await client.get("/readyz")).json())["workers"] == {"future": None}
    assert await redis.hget(KEYS.workers, "future") == b"\xc1 not msgpack"


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


async def test_one_age_decides_the_models_listed_and_the_limits_admitted_against(client: TestClient,
                                                                                 redis: aioredis.Redis) -> None:
    """A worker that died 2 minutes ago (past the 60 s max age) neither names its model nor bounds the prompts: only the
    live worker's context length applies. A heartbeat that cannot be read, or has no time, says nothing."""
    now = time.time()
    await redis.hset(KEYS.workers, "dead", msgpack.packb({"time": now - 120, "model": "old", "max_model_len": 16,
                                                          "vocab_size": 50}))
    await redis.hset(KEYS.workers, "timeless", msgpack.packb({"model": "odd", "max_model_len": 8}))
    await redis.hset(KEYS.workers, "future", b"\xc1 not msgpack")
    await redis.hset(KEYS.workers, "live", msgpack.packb({"time": now, "model": "tiny", "max_model_len": 64,
                                                          "vocab_size": 1000}))
    assert [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]] == ["tiny"]
    fits = {"prompt_token_ids": list(range(40)), "params": {"max_tokens": 8}}
    assert (await client.post("/v1/jobs", json=fits)).status == 202
    too_long = {"prompt_token_ids": list(range(60)), "params": {"max_tokens": 8}}
    resp = await client.post("/v1/jobs", json=too_long)
    assert resp.status == 400 and (await resp.json())["error"]["field"] == "params.max_tokens"
    past_vocabulary = {"prompt_token_ids": [999, 1000], "params": {"max_tokens": 1}}
    resp = await client.post("/v1/jobs", json=past_vocabulary)
    assert resp.status == 400 and (await resp.json())["error"]["field"] == "prompt_token_ids"
