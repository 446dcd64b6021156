"""`reply_to` may not name carpool's own keys, and a reply key of the wrong type cannot break a commit."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec, WebhookSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import Lane
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, xadd_job

OWN_KEYS = ["carpool:workers", "carpool:lane:standard", "carpool:webhooks", "carpool:dead", "carpool"]


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


@pytest.mark.parametrize("reply_to", OWN_KEYS)
async def test_the_gateway_refuses_reply_streams_inside_the_key_prefix(
    redis_url: str, redis: aioredis.Redis, reply_to: str
) -> None:
    async with TestClient(GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)))) as client:
        resp = await client.post("/v1/jobs", json={"prompt": "x", "reply_to": reply_to})
        reply = await resp.json()
        assert resp.status == 400, reply
        assert reply["error"]["field"] == "reply_to"
        ok = await client.post("/v1/jobs", json={"prompt": "x", "reply_to": "carpoolish:replies"})
        assert ok.status == 202
    assert await redis.xlen(KEYS.lane("standard")) == 1


async def test_only_a_batchs_own_jobs_reply_to_its_results_stream(redis_url: str, redis: aioredis.Redis) -> None:
    # Knowing a batch's id, a job of the form {batch_id}-{n} replying there could add a result to the batch.
    async with TestClient(GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)))) as client:
        resp = await client.post("/v1/jobs", json={"id": "batch_0123456789abcdef01234567-0", "prompt": "x",
                                                   "reply_to": KEYS.batch_results("batch_0123456789abcdef01234567")})
        reply = await resp.json()
    assert resp.status == 400 and reply["error"]["field"] == "reply_to", reply
    assert await redis.xlen(KEYS.lane("standard")) == 0


async def test_the_worker_refuses_reply_streams_inside_the_key_prefix(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=2, temperature=0)
    async with running_worker(redis_url, engine):
        for i, reply_to in enumerate(OWN_KEYS):
            await xadd_job(client, JobSpec(id=f"inject-{i}", prompt="x", params=params, reply_to=reply_to))
        views = await wait_terminal(client, [f"inject-{i}" for i in range(len(OWN_KEYS))], timeout_s=30)
    for view in views.values():
        assert view["status"] == "failed"
        assert (view["error"]["type"], view["error"]["field"]) == ("invalid_job", "reply_to")
    assert await client.xlen(KEYS.lane(Lane.STANDARD)) == 0  # nothing injected into the lane
    assert await client.type(KEYS.workers) in (b"hash", b"none")
    assert await client.xlen(KEYS.dead) == len(OWN_KEYS)
    await client.aclose()


async def test_a_reply_key_of_another_type_leaves_the_rest_of_the_commit_whole(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.hset("replies:a-hash", "owner", "someone else")
    spec = JobSpec(id="wrong-type", prompt="x", params=SamplingParams(max_tokens=2, temperature=0),
                   reply_to="replies:a-hash", webhook=WebhookSpec(url="https://hooks.example/done"))
    async with running_worker(redis_url, engine) as service:
        await xadd_job(client, spec)
        views = await wait_terminal(client, ["wrong-type"], timeout_s=30)
        assert not service.has_failed
    assert views["wrong-type"]["status"] == "succeeded"
    assert (await client.xpending(KEYS.lane(Lane.STANDARD), CONSUMER_GROUP))["pending"] == 0
    events = {fields[b"event"] for _, fields in await client.xrange(KEYS.webhooks)}
    assert b"completed" in events
    assert await client.hgetall("replies:a-hash") == {b"owner": b"someone else"}
    await client.aclose()


async def test_cancelling_a_queued_job_whose_reply_key_has_another_type(redis_url: str, redis: aioredis.Redis) -> None:
    await redis.set("replies:a-string", "not a stream")
    webhooks = WebhookConfig(webhook_secret=generate_secret(), webhook_allow=["hooks.test"])
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, webhooks=webhooks)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        resp = await client.post("/v1/jobs", json={"prompt": "x", "reply_to": "replies:a-string",
                                                   "webhook": {"url": "http://hooks.test/done"}})
        job_id = (await resp.json())["id"]
        resp = await client.delete(f"/v1/jobs/{job_id}")
        assert resp.status == 202, await resp.text()
        assert (await resp.json())["status"] == "cancelled"
    assert await redis.get("replies:a-string") == b"not a stream"
    deliveries = [fields[b"event"] for _, fields in await redis.xrange(KEYS.webhooks)]
    assert deliveries == [b"completed"]


async def test_an_invalid_direct_job_is_answered_where_its_producer_waits(redis_url: str, engine) -> None:
    import json

    import msgpack

    client = aioredis.Redis.from_url(redis_url)
    job = {"v": 1, "id": "bad-prompt", "prompt": "", "reply_to": "my-results",
           "webhook": {"url": "https://hooks.example/done"}}
    async with running_worker(redis_url, engine):
        entry_id = (await client.xadd(KEYS.lane(Lane.BATCH), {"job": json.dumps(job)})).decode()
        views = await wait_terminal(client, ["bad-prompt"], timeout_s=30)
    view = views["bad-prompt"]
    assert view["status"] == "failed" and (view["error"]["type"], view["error"]["field"]) == ("invalid_job", "prompt")
    # The record knows the lane it waited in and when it was enqueued, as a valid job's does.
    assert view["lane"] == "batch" and view["created_at"] == int(entry_id.split("-")[0]) / 1000
    (reply,) = await client.xrange("my-results")
    result = msgpack.unpackb(reply[1][b"result"])
    assert (result["id"], result["status"], result["error"]["field"]) == ("bad-prompt", "failed", "prompt")
    deliveries = [(f[b"job_id"], f[b"event"]) for _, f in await client.xrange(KEYS.webhooks)]
    assert deliveries == [(b"bad-prompt", b"completed")]
    await client.aclose()
