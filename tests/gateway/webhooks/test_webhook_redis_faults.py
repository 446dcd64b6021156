"""The webhook dispatcher over a Redis that is full or silent: it waits it out and goes on delivering, never
stops, never hangs, and sends each delivery at least once, signed, under one webhook id."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.webhooks.dispatcher import WebhookDispatcher
from gateway.webhooks.signing import generate_secret
from scheduler.protocol.redis_client import connect
from tests.gateway.webhooks.test_webhook_dispatcher import KEYS, enqueue, fast_config, job_attempts, states_are
from tests.harness.webhook_receiver import Receiver
from tests.harness.worker_harness import wait_until

REDIS_TIMEOUT_S = 2.0
"""The dispatcher's client's timeout here: how long it waits on a silent Redis."""


@pytest.fixture
def secret() -> str:
    return generate_secret()


@pytest.fixture
async def receiver(secret: str) -> AsyncIterator[Receiver]:
    r = await Receiver(secret).start()
    yield r
    await r.stop()


async def test_the_dispatcher_waits_out_redis_at_maxmemory(redis_url: str, receiver: Receiver, secret: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    first = await enqueue(client, "full-1", "completed", receiver.url)
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "1")
    dispatcher_redis = connect(redis_url)
    try:
        async with WebhookDispatcher(dispatcher_redis, KEYS, fast_config(secret)) as dispatcher:
            await asyncio.sleep(0.5)  # many polls meet the refusal
            await client.config_set("maxmemory", "0")
            await wait_until(lambda: states_are(client, [first], b"delivered"), "the delivery once memory is free",
                             timeout_s=30)
            second = await enqueue(client, "full-2", "completed", receiver.url)
            await wait_until(lambda: states_are(client, [second], b"delivered"), "a later delivery", timeout_s=30)
            assert dispatcher.task is not None and not dispatcher.task.done()
    finally:
        await client.config_set("maxmemory", "0")
        await dispatcher_redis.aclose()
        await client.aclose()
    assert receiver.bad_signatures == 0
    assert [r.headers["webhook-id"] for r in receiver.received] == [first, second]


async def test_a_silent_redis_neither_hangs_the_dispatcher_nor_loses_a_delivery(
        tmp_path: Path, receiver: Receiver, secret: str) -> None:
    server = EmbeddedRedis(tmp_path / "redis", is_persistent=False).start()
    pid = server._proc.pid  # type: ignore[union-attr]
    client = aioredis.Redis.from_url(server.url)
    dispatcher_redis = connect(server.url, timeout_s=REDIS_TIMEOUT_S)
    try:
        first = await enqueue(client, "silent-1", "completed", receiver.url)
        dispatcher = WebhookDispatcher(dispatcher_redis, KEYS, fast_config(secret))
        dispatcher.start()
        await wait_until(lambda: states_are(client, [first], b"delivered"), "the first delivery", timeout_s=30)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)  # the dispatcher's polls now wait on a Redis that answers nothing
            # Stopping ends, although Redis never answers.
            await asyncio.wait_for(dispatcher.close(), 4 * REDIS_TIMEOUT_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        second = await enqueue(client, "silent-2", "completed", receiver.url)
        async with WebhookDispatcher(dispatcher_redis, KEYS, fast_config(secret)) as again:
            # And one that meets the silence while running carries on afterwards.
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(REDIS_TIMEOUT_S + 2)
            finally:
                os.kill(pid, signal.SIGCONT)
            third = await enqueue(client, "silent-3", "completed", receiver.url)
            await wait_until(lambda: states_are(client, [second, third], b"delivered"), "the later deliveries",
                             timeout_s=60)
            assert again.task is not None and not again.task.done()
    finally:
        await dispatcher_redis.aclose()
        await client.aclose()
        server.stop()
    assert receiver.bad_signatures == 0
    assert sorted({r.headers["webhook-id"] for r in receiver.received}) == sorted([first, second, third])


async def test_misbehaving_receivers_hold_up_nobody_and_each_ends_as_documented(
        redis_url: str, receiver: Receiver, secret: str) -> None:
    """One receiver never answers, one redirects (to a receiver that would accept), one resets the connection,
    one answers an endless body: a good receiver is served meanwhile, and each bad one is retried on the
    schedule, each attempt ending within the timeout, then dead-lettered."""

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        return web.Response()

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(receiver.url)

    async def reset(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"x" * 65536)
        except ConnectionError:  # the dispatcher hung up without reading it
            return response

    app = web.Application()
    for handler in (hang, redirect, reset, endless):
        app.router.add_post(f"/{handler.__name__}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = aioredis.Redis.from_url(redis_url)
    config = fast_config(secret, webhook_timeout_s=2.0, webhook_retry_schedule_s=[0.2, 0.2])
    try:
        bad = {name: await enqueue(client, f"job-{name}", "completed", f"http://127.0.0.1:{port}/{name}")
               for name in ("hang", "redirect", "reset")}
        endless_id = await enqueue(client, "job-endless", "completed", f"http://127.0.0.1:{port}/endless")
        async with WebhookDispatcher(connect(redis_url), KEYS, config):
            await wait_until(lambda: states_are(client, [bad["hang"]], b"sending"),
                             "the first attempt at the silent receiver", timeout_s=30)
            good = await enqueue(client, "job-good", "completed", receiver.url)
            await wait_until(lambda: states_are(client, [good, endless_id], b"delivered"),
                             "the good receiver's delivery", timeout_s=30)
            assert await states_are(client, [bad["hang"]], b"sending")
            await wait_until(lambda: states_are(client, list(bad.values()), b"dead"), "the bad ones dead-lettered",
                             timeout_s=60)
        for name, delivery_id in bad.items():
            attempts = await job_attempts(client, f"job-{name}")
            assert [a["outcome"] for a in attempts] == ["retrying", "retrying", "dead"], (name, attempts)
        assert {a["error"] for a in await job_attempts(client, "job-hang")} == {"timed out after 2 s"}
        assert {a["status_code"] for a in await job_attempts(client, "job-redirect")} == {307}
        assert await client.xlen(KEYS.webhooks_dead) == 3
    finally:
        await runner.cleanup()
        await client.aclose()
    # Redirects are not followed: the receiver they point at got only its own delivery.
    assert [r.headers["webhook-id"] for r in receiver.received] == [good]
