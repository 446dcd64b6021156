"""The `carpool` command: one verb per process kind.

`up`, `gateway`, `submit`, `batch` and `keys` live here; `worker` and `generate` belong to
`worker.cli` and `webhooks` to `gateway.webhooks.cli`, imported only
when those verbs run, so the gateway never loads torch. Configuration is read
once, here: flags first, then `CARPOOL_<FLAG>` variables, then defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gateway.batch_cli import add_batch_flags, run_batch
from gateway.config import GatewayConfig
from gateway.flags import add_config_flags, config_from_args
from gateway.keys_cli import add_keys_flags, run_keys
from gateway.submit import add_submit_flags, run_submit
from gateway.up import UpConfig, default_data_dir, run_up
from gateway.up_worker import WorkerChild
from gateway.webhooks.config import WebhookConfig
from scheduler.checkpoint import OFFLINE_ENV

DELEGATED_VERBS: dict[str, str] = {
    "worker": "run a GPU/CPU worker: consume the lanes, batch jobs, write results",
    "generate": "run the offline engine once on a prompt and print the completion",
    "webhooks": "run a webhook dispatcher on its own (the gateway also runs one)",
}
"""Verbs whose flags live with their own module; `carpool VERB --help` shows them."""


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool", description="Queue-fed LLM inference over Redis Streams.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    up = verbs.add_parser("up", help="start Redis (bundled unless --redis-url), the gateway and one worker")
    add_config_flags(up, UpConfig, env)
    # `up` runs a worker, so it takes the worker's engine flags (worker.config imports no torch).
    from worker.config import ENGINE_FLAGS, WorkerConfig

    add_config_flags(up, WorkerConfig, env, exclude=set(WorkerConfig.__dataclass_fields__) - set(ENGINE_FLAGS))
    add_config_flags(up, WebhookConfig, env)
    up.add_argument("--log-level", default=env.get("CARPOOL_LOG_LEVEL", "WARNING"),
                    help="log level of the gateway and the worker (default: WARNING) [env CARPOOL_LOG_LEVEL]")

    gateway = verbs.add_parser("gateway", help="run the HTTP gateway")
    add_config_flags(gateway, GatewayConfig, env)
    add_config_flags(gateway, WebhookConfig, env)
    gateway.add_argument("--log-level", default=env.get("CARPOOL_LOG_LEVEL", "INFO"), help="[env CARPOOL_LOG_LEVEL]")

    submit = verbs.add_parser("submit", help="send one prompt to a gateway; --wait prints the completion")
    add_submit_flags(submit, env)

    batch = verbs.add_parser("batch", help="the Batch API: submit a JSONL file (--wait shows progress), status, cancel")
    add_batch_flags(batch, env)

    keys = verbs.add_parser("keys", help="API keys: create (shown once), list, revoke; limits per key")
    add_keys_flags(keys, env)

    for verb, help_text in DELEGATED_VERBS.items():
        verbs.add_parser(verb, help=help_text, add_help=False)
    verbs.add_parser("bench", help="benchmark the batching modes and transformers peers; writes a report", add_help=False)
    verbs.add_parser("redis-cli", help="the bundled redis-cli, connected to carpool up's Redis", add_help=False)
    return parser


def _delegate(verb: str) -> Callable[[list[str], Mapping[str, str]], int]:
    if verb in ("worker", "generate"):
        from worker.cli import main as worker_main

        return lambda rest, env: worker_main([verb, *rest], env)
    from gateway.webhooks.cli import main as webhooks_main

    return lambda rest, env: webhooks_main(rest)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # carpool never downloads a model: transformers reads these at import, and child processes inherit them.
    os.environ.update(OFFLINE_ENV)
    environ = os.environ if env is None else env
    if args_list and args_list[0] in DELEGATED_VERBS:
        return _delegate(args_list[0])(args_list[1:], environ)
    if args_list and args_list[0] == "redis-cli":
        from gateway.redis_cli import main as redis_cli_main

        return redis_cli_main(args_list[1:], environ, default_data_dir(Path.home()))
    if args_list and args_list[0] == "bench":
        from bench.cli import main as bench_main

        return bench_main(args_list[1:], environ)
    parser = build_parser(environ)
    args = parser.parse_args(args_list)
    if args.verb == "submit":
        return run_submit(args)
    if args.verb == "batch":
        return run_batch(args)
    if args.verb == "keys":
        data_dir = Path(environ["CARPOOL_DATA_DIR"]).expanduser() if environ.get("CARPOOL_DATA_DIR") else None
        return run_keys(args, data_dir or default_data_dir(Path.home()))
    try:
        webhooks = config_from_args(WebhookConfig, args)
        if args.verb == "up":
            from worker.config import ENGINE_FLAGS, WorkerConfig

            up = config_from_args(UpConfig, args)
            engine = config_from_args(WorkerConfig, args, exclude=set(WorkerConfig.__dataclass_fields__) - set(ENGINE_FLAGS))
            engine.check_model()
        else:
            gateway = config_from_args(GatewayConfig, args, webhooks=webhooks)
    except ValueError as e:
        if args.verb == "up":
            print(f"carpool up: {e}", file=sys.stderr)
            return 2
        parser.error(str(e))
    if args.verb == "up":
        data_dir = Path(up.data_dir).expanduser() if up.data_dir else default_data_dir(Path.home())
        from scheduler.log_format import configure_logging
        from scheduler.telemetry import telemetry_config_from_env

        # The same JSON logs and OTEL_* telemetry as `carpool gateway`; the worker child reads OTEL_* itself.
        telemetry_config = telemetry_config_from_env(environ, service_name="carpool-gateway")
        configure_logging(args.log_level.upper(), service=telemetry_config.service_name)
        return run_up(up, WorkerChild(engine, ENGINE_FLAGS, args.log_level), webhooks, data_dir, telemetry_config)
    return run_gateway(gateway, args.log_level, environ)


def run_gateway(config: GatewayConfig, log_level: str, env: Mapping[str, str] | None = None) -> int:
    from aiohttp import web

    from gateway.app import init_app
    from scheduler.log_format import configure_logging
    from scheduler.telemetry import Telemetry, telemetry_config_from_env

    configure_logging(log_level.upper(), service="carpool-gateway")
    telemetry = Telemetry(telemetry_config_from_env(env or {}, service_name="carpool-gateway"))
    try:
        web.run_app(
            init_app(config, telemetry), host=config.host, port=config.port, shutdown_timeout=config.shutdown_grace_s,
            print=lambda line: print(f"carpool gateway: {line}", flush=True),
        )
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
