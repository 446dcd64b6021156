"""``carpool webhooks``: flags, the serve loop around one ``WebhookDispatcher``, and the entry point.

Run it with ``carpool webhooks`` or ``python -m gateway.webhooks.cli``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from aiohttp import web
from redis.exceptions import RedisError

from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.dispatcher import WebhookDispatcher
from gateway.webhooks.metrics import WebhookMetrics, dispatcher_http_app
from gateway.webhooks.signing import generate_secret
from gateway.webhooks.store import DeliveryStore
from scheduler.protocol.keys import DEFAULT_PREFIX, Keys, check_key_prefix
from scheduler.protocol.redis_client import REDIS_TIMEOUT_S, RedisRefused, check_access, check_redis_url, redacted_url
from scheduler.protocol.redis_client import connect as connect_redis
from scheduler.runtime.tasks import cancel_and_reap
from scheduler.telemetry.otel import Telemetry

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9465
"""Next to the worker's 9464, so one host can run both."""


def parse_args(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    from scheduler.runtime.flags import add_config_flags

    parser = argparse.ArgumentParser(
        prog="carpool webhooks", description="Send signed webhook callbacks queued in Redis, with retries."
    )
    parser.add_argument("--redis-url", default=env.get("CARPOOL_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="Redis server holding the webhook queue [env CARPOOL_REDIS_URL]")
    parser.add_argument("--redis-timeout-s", type=float,
                        default=env.get("CARPOOL_REDIS_TIMEOUT_S", str(REDIS_TIMEOUT_S)),
                        help="longest wait for Redis to connect or to answer one command; past it Redis counts as "
                             "unavailable and the dispatcher retries [env CARPOOL_REDIS_TIMEOUT_S]")
    parser.add_argument("--key-prefix", default=env.get("CARPOOL_KEY_PREFIX", DEFAULT_PREFIX),
                        help="prefix of every Redis key [env CARPOOL_KEY_PREFIX]")
    parser.add_argument("--generate-secret", action="store_true", help="print a new whsec_ signing secret and exit")
    parser.add_argument("--replay-dead", metavar="IDS",
                        help="put dead-lettered deliveries (`carpool:webhooks:dead`) back on the webhook stream, each "
                             "under its own webhook-id, and exit: `all`, or delivery ids (msg_...) separated by commas; "
                             "a running dispatcher sends them")
    parser.add_argument("--log-level", default=env.get("CARPOOL_LOG_LEVEL", "INFO"), help="[env CARPOOL_LOG_LEVEL]")
    parser.add_argument("--metrics-host", default=env.get("CARPOOL_METRICS_HOST", "127.0.0.1"),
                        help="address of the /metrics and /healthz server (default 127.0.0.1: loopback unless set; the "
                             "gateway image sets 0.0.0.0) [env CARPOOL_METRICS_HOST]")
    parser.add_argument("--metrics-port", type=int, default=env.get("CARPOOL_METRICS_PORT", str(DEFAULT_METRICS_PORT)),
                        help=f"port of /metrics and /healthz; 0 turns the server off (default {DEFAULT_METRICS_PORT}) "
                             "[env CARPOOL_METRICS_PORT]")
    add_config_flags(parser, WebhookConfig, env)
    return parser.parse_args(list(argv))


class ListenError(Exception):
    """The metrics server could not listen (the port is taken, the address is not this host's)."""


async def serve(redis_url: str, keys: Keys, config: WebhookConfig, telemetry: Telemetry | None = None, *,
                metrics_host: str = "127.0.0.1", metrics_port: int = 0, redis_timeout_s: float = REDIS_TIMEOUT_S) -> None:
    """Run one dispatcher until SIGTERM or SIGINT, then shut it down in two phases.

    With ``telemetry``, attempts are counted and traced there; with a ``metrics_port`` too, they are
    served on ``/metrics`` beside a ``/healthz`` that fails once the delivery loop has stopped.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = connect_redis(redis_url, timeout_s=redis_timeout_s)
    metrics = WebhookMetrics(telemetry) if telemetry is not None else None
    http: web.AppRunner | None = None
    try:
        await check_access(client)  # raises RedisRefused: wrong credentials or ACL, which no wait mends
        async with WebhookDispatcher(client, keys, config, observer=metrics) as dispatcher:
            assert dispatcher.task is not None
            task = dispatcher.task
            if metrics is not None and metrics_port:
                http = web.AppRunner(dispatcher_http_app(metrics, lambda: not task.done()))
                await http.setup()
                try:
                    await web.TCPSite(http, metrics_host, metrics_port).start()
                except OSError as e:  # the port is taken, or the address is not this host's
                    reason = os.strerror(e.errno) if e.errno else str(e)
                    raise ListenError(f"cannot serve /metrics on {metrics_host}:{metrics_port}: {reason}") from e
                log.info("webhook dispatcher metrics on http://%s:%d/metrics", metrics_host, metrics_port)
            log.info("webhook dispatcher %s running on %s", dispatcher.name, redacted_url(redis_url))
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_reap(waiter)
    finally:
        if http is not None:
            await http.cleanup()
        await client.aclose()


def replay_dead(args: argparse.Namespace, config: WebhookConfig) -> int:
    """`--replay-dead`: 0 when every delivery asked for went back on the stream, 1 when some were not in the dead
    stream (or live again), 2 for a malformed setting."""
    wanted = None if args.replay_dead.strip() == "all" else {i.strip() for i in args.replay_dead.split(",") if i.strip()}
    if wanted is not None and not wanted:
        print("carpool webhooks: --replay-dead: give `all` or delivery ids separated by commas", file=sys.stderr)
        return 2
    try:
        check_redis_url(args.redis_url)
        check_key_prefix(args.key_prefix)
    except ValueError as e:
        print(f"carpool webhooks: {e}", file=sys.stderr)
        return 2

    async def run() -> list[str]:
        client = connect_redis(args.redis_url, timeout_s=args.redis_timeout_s)
        try:
            store = DeliveryStore(client, Keys(args.key_prefix), ttl_s=config.webhook_ttl_s)
            return await store.replay_dead(wanted, now=time.time())
        finally:
            await client.aclose()

    try:
        moved = asyncio.run(run())
    except (RedisRefused, RedisError, OSError) as e:
        print(f"carpool webhooks: Redis at {redacted_url(args.redis_url)}: {e}", file=sys.stderr)
        return 1
    print(f"replayed {len(moved)} dead-lettered deliver{'y' if len(moved) == 1 else 'ies'}"
          + (f": {', '.join(moved)}" if moved else ""))
    missing = sorted(wanted - set(moved)) if wanted is not None else []
    if missing:
        print(f"carpool webhooks: not in {Keys(args.key_prefix).webhooks_dead} as dead deliveries: "
              f"{', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, os.environ)
    if args.generate_secret:
        print(generate_secret())
        return 0
    from scheduler.runtime.flags import config_from_args, flag_error
    from scheduler.telemetry.log_format import check_log_level, configure_logging
    from scheduler.telemetry.otel import telemetry_config_from_env

    try:
        config = config_from_args(WebhookConfig, args)
    except ValueError as e:
        print(f"carpool webhooks: {flag_error(str(e), WebhookConfig, env=os.environ, argv=argv)}", file=sys.stderr)
        return 2
    if args.replay_dead is not None:
        return replay_dead(args, config)
    if config.webhook_secret is None:
        print("carpool webhooks: --webhook-secret (or CARPOOL_WEBHOOK_SECRET) is required", file=sys.stderr)
        return 2
    if not 0 <= args.metrics_port <= 65535:
        print(f"carpool webhooks: --metrics-port: must be a TCP port or 0, got {args.metrics_port}", file=sys.stderr)
        return 2
    if not args.redis_timeout_s > 0:
        print(f"carpool webhooks: --redis-timeout-s: must be positive, got {args.redis_timeout_s}", file=sys.stderr)
        return 2
    try:
        check_redis_url(args.redis_url)
        check_key_prefix(args.key_prefix)
        log_level = check_log_level(args.log_level)
        telemetry_config = telemetry_config_from_env(os.environ, service_name="carpool-webhooks")
    except ValueError as e:
        said = flag_error(str(e), also=("redis_url", "key_prefix", "log_level"), env=os.environ, argv=argv)
        print(f"carpool webhooks: {said}", file=sys.stderr)
        return 2
    configure_logging(log_level, service=telemetry_config.service_name)
    telemetry = Telemetry(telemetry_config)
    try:
        asyncio.run(serve(args.redis_url, Keys(args.key_prefix), config, telemetry, metrics_host=args.metrics_host,
                          metrics_port=args.metrics_port, redis_timeout_s=args.redis_timeout_s))
    except ListenError as e:
        print(f"carpool webhooks: {e}", file=sys.stderr)
        return 1
    except RedisRefused as e:
        print(f"carpool webhooks: Redis at {redacted_url(args.redis_url)} refuses this dispatcher: {e}",
              file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
