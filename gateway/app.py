"""The gateway's aiohttp application: `init_app(config)` wires one cleanup context per resource.

Shutdown runs in two phases. `on_shutdown` (phase one, after the listener has
stopped taking connections) wakes every long-poll and event stream so open
requests finish promptly; the cleanup contexts (phase two) then stop the
webhook dispatcher, the event hub and the Redis client, in reverse order of
start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from aiohttp import HttpVersion11, web

from gateway import appkeys
from gateway.admission import Admission, WebhookCheck
from gateway.api_keys import KeyStore
from gateway.auth import auth_middleware
from gateway.cancel import Canceller
from gateway.config import GatewayConfig
from gateway.errors import error_middleware
from gateway.event_hub import EventHub
from gateway.handlers import routes
from gateway.metrics import GatewayMetrics, request_id, telemetry_middleware
from gateway.openai.batch_driver import BatchDriver
from gateway.openai.batches import routes as batch_routes
from gateway.openai.files import routes as file_routes
from gateway.openai.online import routes as openai_routes
from gateway.rate_limits import RateLimiter
from gateway.usage import routes as usage_routes
from gateway.webhooks import check_webhook_url_async
from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.dispatcher import WebhookDispatcher
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_client import check_access, connection_options
from scheduler.runtime.tasks import cancel_and_reap
from scheduler.telemetry.otel import Telemetry

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


def init_app(config: GatewayConfig, telemetry: Telemetry | None = None) -> web.Application:
    """``telemetry`` (built by the CLI from the OTEL_* variables) stays the caller's to shut down."""
    # The telemetry middleware is outermost, so it sees the status the error middleware answered.
    metrics = GatewayMetrics(telemetry, config.max_tenant_labels)
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[telemetry_middleware(metrics), error_middleware(config.retry_after_s, config.max_body_bytes,
                                                                        config.max_batch_file_bytes,
                                                                        config.body_timeout_s),
                     auth_middleware(config.api_keys)],
    )
    app[appkeys.CONFIG] = config
    app[appkeys.KEYS] = Keys(config.key_prefix)
    app[appkeys.METRICS] = metrics
    app.cleanup_ctx.append(_metrics_ctx)
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(_hub_ctx)
    app.cleanup_ctx.append(_streams_ctx)
    app.cleanup_ctx.append(_domain_ctx)
    app.cleanup_ctx.append(_batches_ctx)
    if not config.no_webhooks:
        app.cleanup_ctx.append(_webhooks_ctx)
    app.on_response_prepare.append(_add_request_id)
    app.on_response_prepare.append(_close_an_unbounded_http10_body)
    app.on_shutdown.append(_wake_waiters)
    app.router.add_routes(routes)
    app.router.add_routes(openai_routes)
    app.router.add_routes(file_routes)
    app.router.add_routes(batch_routes)
    app.router.add_routes(usage_routes)
    return app


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[appkeys.CONFIG]
    # A bounded pool that makes a command wait for a free connection, up to the timeout (then the
    # request is answered 503): a burst of requests queues instead of failing past the pool size.
    pool = aioredis.BlockingConnectionPool.from_url(
        config.redis_url, max_connections=config.redis_max_connections, timeout=config.redis_pool_timeout_s,
        **connection_options(timeout_s=config.redis_timeout_s),
    )
    client = aioredis.Redis(connection_pool=pool)
    try:
        await check_access(client)  # wrong credentials or ACL: refused at start (RedisRefused), not at every request
    except BaseException:
        await client.aclose()
        raise
    app[appkeys.REDIS] = client
    yield
    await client.aclose()


async def _metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[appkeys.METRICS].close()


async def _streams_ctx(app: web.Application) -> AsyncIterator[None]:
    streams = app[appkeys.METRICS].watch_streams(app[appkeys.REDIS], app[appkeys.KEYS],
                                                 heartbeat_max_age_s=app[appkeys.CONFIG].model_heartbeat_max_age_s)
    yield
    await streams.aclose()


async def _hub_ctx(app: web.Application) -> AsyncIterator[None]:
    hub = EventHub(app[appkeys.REDIS])
    hub.start()
    app[appkeys.HUB] = hub
    yield
    await hub.stop()


async def _domain_ctx(app: web.Application) -> AsyncIterator[None]:
    config, redis, keys = app[appkeys.CONFIG], app[appkeys.REDIS], app[appkeys.KEYS]
    app[appkeys.ADMISSION] = Admission(
        redis, keys, config, _webhook_check(config.webhooks), enqueue_span=app[appkeys.METRICS].enqueue_span
    )
    app[appkeys.CANCELLER] = Canceller(redis, keys, flag_ttl_s=config.result_ttl_s, reply_maxlen=config.reply_maxlen,
                                       metrics=app[appkeys.METRICS])
    app[appkeys.KEY_STORE] = KeyStore(redis, keys)
    app[appkeys.LIMITER] = RateLimiter(redis, keys)
    yield


async def _batches_ctx(app: web.Application) -> AsyncIterator[None]:
    """The Batch API's driver: one owned task, cancelled and reaped at shutdown."""
    task = asyncio.create_task(BatchDriver(app).run(), name="batch-driver")
    yield
    await cancel_and_reap(task)


async def _webhooks_ctx(app: web.Application) -> AsyncIterator[None]:
    async with WebhookDispatcher(app[appkeys.REDIS], app[appkeys.KEYS], app[appkeys.CONFIG].webhooks, observer=app[appkeys.METRICS]):
        yield


def _webhook_check(config: WebhookConfig) -> WebhookCheck:
    """Submission-time check, resolving the host so a name for a private address is refused up front.

    DNS can change its answer later, so the dispatcher still vets every address it connects to.
    """
    allow = config.allowlist()
    has_secret = config.webhook_secret is not None

    async def check(url: str) -> None:
        if not has_secret:
            raise ValueError("this server has no --webhook-secret, so it cannot sign callbacks")
        await check_webhook_url_async(url, allow)

    return check


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer names itself with ``x-request-id``, as OpenAI's do: the `openai` client shows it as a
    response's ``_request_id`` and an error's ``request_id``."""
    response.headers.setdefault(REQUEST_ID_HEADER, request_id(request))


async def _close_an_unbounded_http10_body(request: web.Request, response: web.StreamResponse) -> None:
    """An HTTP/1.0 answer streamed without a length (an event stream, a file's content) can end only with its
    connection: 1.0 has no chunked encoding. aiohttp sends it so but keeps a connection the client asked to keep
    alive, so the client would wait for the end until the keep-alive timeout; the connection is closed after it."""
    has_body = request.method != "HEAD" and response.status >= 200 and response.status not in (204, 304)
    if request.version < HttpVersion11 and has_body and response.content_length is None and not response.chunked:
        response.force_close()


async def _wake_waiters(app: web.Application) -> None:
    app[appkeys.HUB].close_waiters()
