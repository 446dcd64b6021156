"""The gateway's aiohttp application: `init_app(config)` wires one cleanup context per resource.

Shutdown runs in two phases. `on_shutdown` (phase one, after the listener has
stopped taking connections) wakes every long-poll and event stream so open
requests finish promptly; the cleanup contexts (phase two) then stop the
webhook dispatcher, the event hub and the Redis client, in reverse order of
start.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from functools import partial

import redis.asyncio as aioredis
from aiohttp import web

from gateway import appkeys as K
from gateway.admission import Admission
from gateway.cancel import Canceller
from gateway.config import GatewayConfig
from gateway.handlers import routes
from gateway.metrics import GatewayMetrics
from gateway.results import EventHub
from gateway.webhooks import Allowlist, check_webhook_url
from scheduler.keys import Keys

log = logging.getLogger(__name__)


def init_app(config: GatewayConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    app[K.CONFIG] = config
    app[K.KEYS] = Keys(config.key_prefix)
    app[K.METRICS] = GatewayMetrics()
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(_hub_ctx)
    app.cleanup_ctx.append(_domain_ctx)
    if not config.no_webhooks:
        app.cleanup_ctx.append(_webhooks_ctx)
    app.on_shutdown.append(_wake_waiters)
    app.router.add_routes(routes)
    return app


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    client = aioredis.Redis.from_url(app[K.CONFIG].redis_url, health_check_interval=30)
    app[K.REDIS] = client
    yield
    await client.aclose()


async def _hub_ctx(app: web.Application) -> AsyncIterator[None]:
    hub = EventHub(app[K.REDIS])
    hub.start()
    app[K.HUB] = hub
    yield
    await hub.stop()


async def _domain_ctx(app: web.Application) -> AsyncIterator[None]:
    config, redis, keys = app[K.CONFIG], app[K.REDIS], app[K.KEYS]
    allow = Allowlist.parse(config.webhook_allow)
    app[K.ADMISSION] = Admission(redis, keys, config, partial(check_webhook_url, allow=allow))
    app[K.CANCELLER] = Canceller(redis, keys, flag_ttl_s=config.result_ttl_s)
    yield


async def _webhooks_ctx(app: web.Application) -> AsyncIterator[None]:
    from gateway.webhooks.dispatcher import run_in_app  # the dispatcher is optional at import time

    async with run_in_app(app[K.CONFIG], app[K.REDIS], app[K.KEYS]):
        yield


async def _wake_waiters(app: web.Application) -> None:
    app[K.HUB].close_waiters()
