"""The gateway over a Redis that is full, silent or gone: every request ends, what Redis cannot serve is answered
503 with ``Retry-After`` (never a 500, never a hang), nothing is half-accepted, and everything works again once
Redis is back, without a restart."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys
from scheduler.protocol.lanes import Lane
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import wait_until

KEYS = Keys("carpool")
REDIS_TIMEOUT_S = 2.0
"""The gateway's --redis-timeout-s here: how long it waits on a silent Redis."""
ENDS_WITHIN_S = 4 * REDIS_TIMEOUT_S
"""A generous bound on how long a request may take to end while Redis is silent."""


@asynccontextmanager
async def gateway_client(redis_url: str, **settings: Any) -> AsyncIterator[TestClient]:
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, retry_after_s=3, redis_timeout_s=REDIS_TIMEOUT_S,
                           **settings)
    async with TestClient(GatewayTestServer(init_app(config), host="127.0.0.1")) as client:
        yield client


@asynccontextmanager
async def at_maxmemory(redis_url: str) -> AsyncIterator[None]:
    """Redis refusing every write (``maxmemory`` 1 byte, ``noeviction``) until the block ends."""
    admin = aioredis.Redis.from_url(redis_url)
    await admin.config_set("maxmemory-policy", "noeviction")
    await admin.config_set("maxmemory", "1")
    try:
        yield
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.aclose()


@contextmanager
def stopped(server: EmbeddedRedis) -> Iterator[None]:
    """The redis-server process stopped (SIGSTOP): it keeps its connections open and answers nothing."""
    pid = server._proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def assert_unavailable(resp: aiohttp.ClientResponse, *, is_openai: bool = False) -> str:
    """A 503 with ``Retry-After`` in the route's error shape; returns its message."""
    body = await resp.json()
    assert resp.status == 503, body
    assert resp.headers["Retry-After"] == "3"
    if is_openai:
        assert body["error"]["type"] == "server_error"
    else:
        assert body["error"]["type"] == "unavailable"
    return str(body["error"]["message"])


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
BATCH_LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT})


async def upload(client: TestClient, content: str) -> aiohttp.ClientResponse:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content.encode(), filename="batch.jsonl")
    return await client.post("/v1/files", data=form)


async def test_at_maxmemory_writes_are_503_with_retry_after_reads_go_on_and_it_recovers(redis_url: str) -> None:
    async with gateway_client(redis_url) as client:
        resp = await client.post("/v1/jobs", json={"prompt": "before"})
        assert resp.status == 202
        before = (await resp.json())["id"]
        redis = aioredis.Redis.from_url(redis_url)
        # A heartbeat long stale, which /readyz prunes: at maxmemory the pruning waits, and /readyz still answers.
        await redis.hset(KEYS.workers, "long-gone", msgpack.packb({"time": time.time() - 3600}))

        async with at_maxmemory(redis_url):
            message = await assert_unavailable(await client.post("/v1/jobs", json={"prompt": "while full"}))
            assert "maxmemory" in message
            await assert_unavailable(await client.post("/v1/jobs", json={"prompt": "keyed"},
                                                       headers={"Idempotency-Key": "full-1"}))
            await assert_unavailable(await client.post("/v1/chat/completions", json=CHAT), is_openai=True)
            await assert_unavailable(await client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
                                     is_openai=True)
            await assert_unavailable(await upload(client, BATCH_LINE + "\n"), is_openai=True)
            await assert_unavailable(await client.delete(f"/v1/jobs/{before}"))
            # Reads need no memory.
            resp = await client.get(f"/v1/jobs/{before}")
            assert resp.status == 200 and (await resp.json())["status"] == "queued"
            assert (await client.get("/readyz")).status == 200
        assert (await client.get("/readyz")).status == 200 and not await redis.hexists(KEYS.workers, "long-gone")
        await redis.aclose()

        resp = await client.post("/v1/jobs", json={"prompt": "keyed"}, headers={"Idempotency-Key": "full-1"})
        assert resp.status == 202, await resp.text()
        after = (await resp.json())["id"]
    # The refused requests left nothing behind: only the two accepted jobs wait in the lane.
    redis = aioredis.Redis.from_url(redis_url)
    entries = await redis.xrange(KEYS.lane(Lane.STANDARD))
    await redis.aclose()
    assert len(entries) == 2 and before != after


async def test_the_batch_driver_outlives_redis_at_maxmemory(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    # A batch the driver takes up at every round: at maxmemory, taking its lock is refused.
    await redis.sadd(KEYS.batches_active, "batch_waiting")
    async with gateway_client(redis_url, batch_poll_interval_s=0.05) as client:
        async with at_maxmemory(redis_url):
            await asyncio.sleep(0.5)  # several of the driver's rounds meet the refusal
        resp = await upload(client, BATCH_LINE + "\n")
        assert resp.status == 200, await resp.text()
        file_id = (await resp.json())["id"]
        resp = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"})
        assert resp.status == 200, await resp.text()
        batch_id = (await resp.json())["id"]

        async def is_taken_up() -> bool:
            batch = await (await client.get(f"/v1/batches/{batch_id}")).json()
            return bool(batch["status"] != "validating")

        await wait_until(is_taken_up, "the batch driver taking up a new batch after the memory was freed", timeout_s=30)
    await redis.aclose()


async def test_a_silent_redis_ends_every_request_with_503_and_it_recovers_without_a_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", is_persistent=False).start()
    try:
        async with gateway_client(server.url, sse_heartbeat_s=0.2) as client:
            resp = await client.post("/v1/jobs", json={"prompt": "before"})
            assert resp.status == 202
            before = (await resp.json())["id"]
            events = await client.get(f"/v1/jobs/{before}/events")
            assert events.status == 200

            with stopped(server):
                resp = await asyncio.wait_for(
                    client.post("/v1/jobs", json={"prompt": "while silent"}, headers={"Idempotency-Key": "silent-1"}),
                    ENDS_WITHIN_S)
                message = await assert_unavailable(resp)
                assert "Idempotency-Key" in message  # the job may have been accepted: say how to retry safely
                await assert_unavailable(await asyncio.wait_for(client.get(f"/v1/jobs/{before}?wait=30"), ENDS_WITHIN_S))
                message = await assert_unavailable(await asyncio.wait_for(
                    client.post("/v1/chat/completions", json={**CHAT, "stream": True}), ENDS_WITHIN_S), is_openai=True)
                # The OpenAI routes take no Idempotency-Key: no advice to repeat one.
                assert "may have been carried out" in message and "Idempotency-Key" not in message, message
                ready = await asyncio.wait_for(client.get("/readyz"), ENDS_WITHIN_S)
                assert (ready.status, ready.headers["Retry-After"]) == (503, "3")
                # The open event stream ends (the client can come back with Last-Event-ID) rather than hang.
                await asyncio.wait_for(events.read(), ENDS_WITHIN_S)

            # The same key again: the job accepted (or not) during the silence is enqueued once.
            statuses = []
            for _ in range(2):
                resp = await client.post("/v1/jobs", json={"prompt": "while silent"},
                                         headers={"Idempotency-Key": "silent-1"})
                statuses.append(resp.status)
                silent_id = (await resp.json())["id"]
            assert statuses in ([200, 200], [202, 200]), statuses
            resp = await client.get(f"/v1/jobs/{before}?wait=0.1")
            assert resp.status == 200
            resumed = await client.get(f"/v1/jobs/{before}/events", headers={"Last-Event-ID": "0.0.0"})
            assert resumed.status == 200
            resumed.close()
        redis = aioredis.Redis.from_url(server.url)
        entries = await redis.xrange(KEYS.lane(Lane.STANDARD))
        await redis.aclose()
        assert len(entries) == 2, entries
        assert silent_id != before
    finally:
        server.stop()


async def test_an_outage_is_logged_once_in_a_while_by_each_of_the_gateways_loops(redis_url: str, caplog) -> None:
    """The event hub, the batch driver and the webhook dispatcher each retry about twice a second while Redis is
    away: each says so once, then once more when Redis is back, not once a retry."""
    from gateway.webhooks import generate_secret
    from gateway.webhooks.config import WebhookConfig
    from tests.harness.redis_proxy import RedisProxy

    proxy = await RedisProxy(redis_url).start()
    webhooks = WebhookConfig(webhook_secret=generate_secret(), webhook_poll_s=0.05)
    config = GatewayConfig(redis_url=proxy.url, no_webhooks=False, webhooks=webhooks, batch_poll_interval_s=0.05,
                           redis_timeout_s=REDIS_TIMEOUT_S)
    try:
        async with TestClient(GatewayTestServer(init_app(config), host="127.0.0.1")) as client:
            job_id = (await (await client.post("/v1/jobs", json={"prompt": "waits"})).json())["id"]
            events = await client.get(f"/v1/jobs/{job_id}/events")  # the hub reads while anyone waits
            with caplog.at_level(logging.INFO):
                proxy.go_down()
                await asyncio.sleep(2.0)
                proxy.restore()
                await wait_until(lambda: _said(caplog, "available again", 3), "each loop saying Redis is back")
            events.close()
    finally:
        await proxy.aclose()
    warnings = [r.getMessage() for r in caplog.records if "Redis unavailable" in r.getMessage()]
    for loop in ("event hub", "batch driver", "webhook dispatcher"):
        assert len([m for m in warnings if m.startswith(loop)]) == 1, warnings
    assert len([m for m in warnings if "left out" in m or "more such" in m]) == 0, warnings


async def test_requests_meeting_an_outage_are_each_answered_503_and_said_once_per_route(redis_url: str,
                                                                                      caplog) -> None:
    """Each request gets its 503 (and its access-log line); the gateway's log says the outage once per route,
    not once per request, which would fill it at the request rate for as long as Redis is away."""
    from tests.harness.redis_proxy import RedisProxy

    proxy = await RedisProxy(redis_url).start()
    config = GatewayConfig(redis_url=proxy.url, redis_timeout_s=REDIS_TIMEOUT_S)
    try:
        async with TestClient(GatewayTestServer(init_app(config), host="127.0.0.1")) as client:
            proxy.go_down()
            with caplog.at_level(logging.INFO):
                statuses = [(await client.post("/v1/jobs", json={"prompt": "x"})).status for _ in range(8)]
                statuses += [(await client.get("/v1/jobs/someone")).status for _ in range(4)]
    finally:
        await proxy.aclose()
    assert statuses == [503] * 12, statuses
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "gateway.errors" and "Redis unavailable" in r.getMessage()]
    assert [m.split(":")[0] for m in warnings] == ["POST /v1/jobs", "GET /v1/jobs/{id}"], warnings
    assert "answered 503 with Retry-After 2s" in warnings[0], warnings


async def _said(caplog, text: str, times: int) -> bool:
    return len([r for r in caplog.records if text in r.getMessage()]) >= times


async def test_a_batch_driver_round_failing_alike_every_time_is_said_once(redis_url: str, caplog) -> None:
    """A key the driver reads each round made another type (the active-batch set SET to a string): said once
    with its traceback, not at every round, and once more when rounds go on again."""
    config = GatewayConfig(redis_url=redis_url, batch_poll_interval_s=0.05)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        async with TestClient(GatewayTestServer(init_app(config), host="127.0.0.1")):
            with caplog.at_level(logging.INFO):
                await admin.set(Keys("carpool").batches_active, "oops")
                await asyncio.sleep(1.0)  # about twenty rounds
                await admin.delete(Keys("carpool").batches_active)
                await wait_until(lambda: _said(caplog, "rounds go on again", 1), "the driver saying it goes on")
    finally:
        await admin.aclose()
    failed = [r for r in caplog.records if "a round failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None, [r.getMessage() for r in failed]
