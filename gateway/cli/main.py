"""The `carpool` command: one verb per process kind.

`up`, `gateway`, `submit`, `batch` and `keys` live here; `worker` and `generate` belong to
`worker.cli` and `webhooks` to `gateway.webhooks.cli`, imported only
when those verbs run, so the gateway never loads torch. Configuration is read
once, here: flags first, then `CARPOOL_<FLAG>` variables, then defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.cli import EXIT_INTERRUPTED
from gateway.cli.batch import add_batch_flags, run_batch
from gateway.cli.keys import add_keys_flags, run_keys
from gateway.cli.submit import EXIT_READER_GONE, add_submit_flags, run_submit
from gateway.cli.up import GATEWAY_SET_BY_UP, SHARED_HELP, WORKER_SET_BY_UP, UpConfig, default_data_dir, run_up
from gateway.cli.up_worker import WorkerChild, check_worker_device
from gateway.config import GatewayConfig
from gateway.webhooks.config import WebhookConfig
from scheduler.protocol.redis_client import RedisRefused, redacted_url
from scheduler.runtime.flags import add_config_flags, config_from_args, flag_error, flag_fields, parse_verb_args
from scheduler.runtime.listen import LISTEN_ERRNOS
from scheduler.runtime.model_path import OFFLINE_ENV

if TYPE_CHECKING:
    from scheduler.telemetry.otel import TelemetryConfig
    from worker.config import WorkerConfig

DELEGATED_VERBS: dict[str, str] = {
    "worker": "run a GPU/CPU worker: consume the lanes, batch jobs, write results",
    "generate": "run the offline engine once on a prompt and print the completion",
    "webhooks": "run a webhook dispatcher on its own (the gateway also runs one)",
}
"""Verbs whose flags live with their own module; `carpool VERB --help` shows them."""


def build_parser(env: Mapping[str, str], verb: str | None = None) -> argparse.ArgumentParser:
    """Every verb's parser; with ``verb``, only that verb reads its defaults from ``env``.

    So a malformed variable of one verb (a worker's ``CARPOOL_MAX_NUM_SEQS`` in a shared environment)
    stops only the verb that takes it, and the error names that verb.
    """
    parser = argparse.ArgumentParser(prog="carpool", description="Queue-fed LLM inference over Redis Streams.")
    parser.add_argument("--version", action="version", version=f"carpool {_version()}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def env_of(name: str) -> Mapping[str, str]:
        return env if verb is None or verb == name else {}

    up = verbs.add_parser("up", help="start Redis (bundled unless --redis-url), the gateway and one worker")
    up_env = env_of("up")
    add_config_flags(up, UpConfig, up_env)
    # `up` runs a worker and a gateway, so it takes their flags (worker.config imports no torch).
    from worker.config import WorkerConfig

    add_config_flags(up, WorkerConfig, up_env, exclude=WORKER_SET_BY_UP, helps=SHARED_HELP)
    add_config_flags(up, GatewayConfig, up_env, exclude=_up_gateway_exclude(WorkerConfig))
    add_config_flags(up, WebhookConfig, up_env)
    up.add_argument("--log-level", default=up_env.get("CARPOOL_LOG_LEVEL", "WARNING"),
                    help="log level of the gateway and the worker (default: WARNING) [env CARPOOL_LOG_LEVEL]")

    gateway = verbs.add_parser("gateway", help="run the HTTP gateway")
    gateway_env = env_of("gateway")
    add_config_flags(gateway, GatewayConfig, gateway_env)
    add_config_flags(gateway, WebhookConfig, gateway_env)
    gateway.add_argument("--log-level", default=gateway_env.get("CARPOOL_LOG_LEVEL", "INFO"),
                         help="debug, info, warning, error or critical (default: INFO) [env CARPOOL_LOG_LEVEL]")

    submit = verbs.add_parser("submit", help="send one prompt to a gateway; --wait prints the completion")
    add_submit_flags(submit, env_of("submit"))

    batch = verbs.add_parser("batch", help="the Batch API: submit a JSONL file (--wait shows progress), status, cancel")
    add_batch_flags(batch, env_of("batch"))

    keys = verbs.add_parser("keys", help="API keys: create (shown once), list, revoke; limits per key")
    add_keys_flags(keys, env_of("keys"))

    for verb, help_text in DELEGATED_VERBS.items():
        verbs.add_parser(verb, help=help_text, add_help=False)
    verbs.add_parser("bench", help="benchmark the batching modes and transformers peers; writes a report", add_help=False)
    verbs.add_parser("redis-cli", help="the bundled redis-cli, connected to carpool up's Redis", add_help=False)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("carpool")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _up_gateway_exclude(worker_config: type[WorkerConfig]) -> set[str]:
    """The gateway's settings that are no flags of their own in `up`: its own, and those the worker shares."""
    return set(GATEWAY_SET_BY_UP) | set(flag_fields(worker_config, WORKER_SET_BY_UP))


def _delegate(verb: str) -> Callable[[list[str], Mapping[str, str]], int]:
    if verb in ("worker", "generate"):
        from worker.cli import main as worker_main

        return lambda rest, env: worker_main([verb, *rest], env)
    from gateway.webhooks.cli import main as webhooks_main

    return lambda rest, env: webhooks_main(rest)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        try:
            return _main(argv, env)
        finally:
            sys.stdout.flush()
    except KeyboardInterrupt:
        # Ctrl-C where a verb has nothing of its own to say about it: no traceback, the shell's exit status.
        print("carpool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read the output stopped reading (`carpool batch status ID | head -2`): stop quietly with the status
        # a shell gives a process that SIGPIPE ended, as other tools do, with stdout sent nowhere so that the
        # interpreter's last flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_READER_GONE


def _main(argv: Sequence[str] | None, env: Mapping[str, str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # carpool never downloads a model: transformers reads these at import, and child processes inherit them.
    os.environ.update(OFFLINE_ENV)
    environ = os.environ if env is None else env
    if args_list and args_list[0] in DELEGATED_VERBS:
        return _delegate(args_list[0])(args_list[1:], environ)
    if args_list and args_list[0] == "redis-cli":
        from gateway.cli.redis_cli import main as redis_cli_main

        return redis_cli_main(args_list[1:], environ, default_data_dir(Path.home()))
    if args_list and args_list[0] == "bench":
        from bench.cli import main as bench_main

        return bench_main(args_list[1:], environ)
    parser = build_parser(environ, verb=args_list[0] if args_list else "")
    args = parse_verb_args(parser, args_list)
    if args.verb == "submit":
        return run_submit(args)
    if args.verb == "batch":
        return run_batch(args)
    if args.verb == "keys":
        return run_keys(args, environ, default_data_dir(Path.home()))
    from scheduler.telemetry.log_format import check_log_level
    from scheduler.telemetry.otel import telemetry_config_from_env

    try:
        log_level = check_log_level(args.log_level)
        # The same OTEL_* telemetry for `up`'s gateway as for `carpool gateway`; the worker child reads OTEL_* itself.
        telemetry_config = telemetry_config_from_env(environ, service_name="carpool-gateway")
        webhooks = config_from_args(WebhookConfig, args)
        if args.verb == "up":
            from worker.config import WorkerConfig

            up = config_from_args(UpConfig, args)
            worker_config = config_from_args(WorkerConfig, args, exclude=WORKER_SET_BY_UP)
            # Checked here, with up's --redis-url where it has one (the bundled Redis's URL replaces it later).
            redis_url = {"redis_url": up.redis_url} if up.redis_url is not None else {}
            gateway = config_from_args(GatewayConfig, args, exclude=("redis_url", "shutdown_grace_s"),
                                       webhooks=webhooks, **redis_url)
            worker_config.check_model()
            check_worker_device(worker_config.engine.device)
        else:
            gateway = config_from_args(GatewayConfig, args, webhooks=webhooks)
    except ValueError as e:
        if args.verb == "up":
            from worker.config import WorkerConfig

            said = flag_error(str(e), UpConfig, WorkerConfig, GatewayConfig, WebhookConfig, env=environ, argv=args_list)
            print(f"carpool up: {said}", file=sys.stderr)
            return 2
        said = flag_error(str(e), GatewayConfig, WebhookConfig, env=environ, argv=args_list)
        parser.exit(2, f"carpool {args.verb}: error: {said}\n")
    if args.verb == "up":
        data_dir = Path(up.data_dir).expanduser() if up.data_dir else default_data_dir(Path.home())
        from gateway.access_log import log_parse_errors_as_client_errors
        from scheduler.telemetry.log_format import configure_logging

        # The same JSON logs as `carpool gateway`.
        configure_logging(log_level, service=telemetry_config.service_name)
        log_parse_errors_as_client_errors()
        # A worker name not given is the worker's own to make (its pid in it), not one made here.
        handed = tuple(name for name in flag_fields(WorkerConfig, WORKER_SET_BY_UP)
                       if name != "worker_name" or args.worker_name)
        child = WorkerChild(worker_config, handed, log_level)
        return run_up(up, gateway, child, data_dir, telemetry_config)
    return run_gateway(gateway, log_level, telemetry_config)




def run_gateway(config: GatewayConfig, log_level: str, telemetry_config: TelemetryConfig) -> int:
    from aiohttp import web

    from gateway.access_log import AccessLogger, log_parse_errors_as_client_errors
    from gateway.app import init_app
    from scheduler.telemetry.log_format import configure_logging
    from scheduler.telemetry.otel import Telemetry

    configure_logging(log_level.upper(), service=telemetry_config.service_name)
    log_parse_errors_as_client_errors()
    telemetry = Telemetry(telemetry_config)
    try:
        web.run_app(
            init_app(config, telemetry), host=config.host, port=config.port, shutdown_timeout=config.shutdown_grace_s,
            access_log_class=AccessLogger, keepalive_timeout=config.keepalive_timeout_s,
            # A log line like every other (one JSON object a line on stderr): aiohttp's "==== Running on ... ====
            # (Press CTRL+C to quit)" banner would be the one line a log shipper cannot parse.
            print=lambda banner: logging.getLogger("gateway").info("carpool gateway: %s",
                                                                    " ".join(banner.replace("=", " ").split())),
        )
    except OSError as e:
        if e.errno not in LISTEN_ERRNOS:
            raise
        print(f"carpool gateway: cannot listen on {config.host}:{config.port}: {os.strerror(e.errno)}", file=sys.stderr)
        return 1
    except RedisRefused as e:
        print(f"carpool gateway: Redis at {redacted_url(config.redis_url)} refuses this gateway: {e}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
