"""`carpool worker` and `carpool generate`: flags in, a running worker (or one completion) out.

`main(argv)` takes the verb and its flags; ``gateway.cli.main`` dispatches here, and
``python -m worker.cli worker ...`` works on its own. Configuration is read
once here (flags, then ``CARPOOL_<FLAG>`` variables) and passed down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler.params import SamplingParams
from scheduler.runtime.flags import add_config_flags, config_from_args, flag_error, parse_verb_args
from scheduler.runtime.listen import LISTEN_ERRNOS, listen_error
from scheduler.runtime.model_path import BUILTIN_MODEL_NOTICE, OFFLINE_ENV
from scheduler.runtime.terminal import printable, prompt_argument
from scheduler.telemetry.log_format import LogSettings, configure_logging
from scheduler.telemetry.otel import Telemetry, TelemetryConfig, telemetry_config_from_env
from worker.config import WorkerConfig
from worker.engine.process import EngineProcess, EngineStartError
from worker.engine.startup_heap import freeze_startup_heap
from worker.engine.tick import EngineThread
from worker.engine.torch_threads import apply_torch_threads
from worker.engine.wire import EngineRunner

log = logging.getLogger("worker")


def build_parser(env: Mapping[str, str], verb: str | None = None) -> argparse.ArgumentParser:
    """Both verbs' parsers; with ``verb``, only that verb reads its defaults from ``env``, so a malformed variable
    is reported by the verb being run (``carpool generate`` reads the worker's engine variables too)."""
    parser = argparse.ArgumentParser(prog="carpool", description="carpool worker verbs")
    verbs = parser.add_subparsers(dest="verb", required=True)
    worker = verbs.add_parser("worker", help="run a worker: consume the lanes, run the engine, commit results")
    add_config_flags(worker, WorkerConfig, env if verb in (None, "worker") else {})
    gen = verbs.add_parser("generate", help="run the offline engine once on a prompt and print the text")
    gen.add_argument("prompt", help="prompt text; - reads it from standard input")
    job_default = SamplingParams()
    gen.add_argument("--max-tokens", type=int, default=job_default.max_tokens,
                     help=f"most tokens to generate (default {job_default.max_tokens}, a job's default, as for "
                          "carpool submit)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 is greedy (default, as for carpool submit; a job's own default is 1.0)")
    gen.add_argument("--top-p", type=float, default=job_default.top_p,
                     help=f"nucleus sampling's probability mass (default {job_default.top_p:g})")
    gen.add_argument("--seed", type=int, default=None, help="seed of a sampled draw (default: none, unseeded)")
    add_config_flags(gen, WorkerConfig, env if verb in (None, "generate") else {}, exclude=_service_fields())
    return parser


GENERATE_PARAMS = ("max_tokens", "temperature", "top_p", "seed")
"""`carpool generate`'s flags of the prompt's own, each a sampling parameter's name."""


def _service_fields() -> list[str]:
    """What ``carpool generate`` does not take: everything but the engine's settings and the torch threads."""
    return [name for name in WorkerConfig.__dataclass_fields__ if name not in ("engine", "torch_threads")]


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    os.environ.update(OFFLINE_ENV)  # before anything imports transformers; the engine process inherits it
    environ = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_verb_args(build_parser(environ, verb=argv[0] if argv else ""), argv)
    if args.verb == "generate":
        try:
            config = config_from_args(WorkerConfig, args, exclude=_service_fields())
            config.check_model()
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                    seed=args.seed)
            prompt = prompt_argument(args.prompt, sys.stdin.buffer)
        except ValueError as e:  # InvalidParam too: it names the setting
            said = flag_error(str(e), WorkerConfig, also=GENERATE_PARAMS, env=environ, argv=argv)
            print(f"carpool generate: {said}", file=sys.stderr)
            return 2
        return generate(config, prompt, params)
    try:
        config = config_from_args(WorkerConfig, args)
        config.check_model()
        telemetry_config = telemetry_config_from_env(environ, service_name="carpool-worker",
                                                     service_instance_id=config.worker_name or None)
    except ValueError as e:
        print(f"carpool worker: {flag_error(str(e), WorkerConfig, env=environ, argv=argv)}", file=sys.stderr)
        return 2
    # Before the model loads: a port the worker will not get ends it now, not after minutes of loading.
    problem = listen_error(config.metrics_host, config.metrics_port) if config.metrics_port else None
    if problem is not None:
        print(f"carpool worker: metrics server {problem}", file=sys.stderr)
        return 1
    logging_settings = log_settings(config)
    configure_logging(logging_settings.level, service=logging_settings.service, is_json=logging_settings.is_json)
    return asyncio.run(serve(config, telemetry_config))


def log_settings(config: WorkerConfig) -> LogSettings:
    """How a worker logs, and its engine process with it."""
    return LogSettings(level=config.log_level.upper(), service="carpool-worker", is_json=True)


def generate(config: WorkerConfig, prompt: str, params: SamplingParams) -> int:
    from worker.engine.engine import Engine

    apply_torch_threads(config.torch_threads, config.engine.device)
    try:
        engine = Engine(config.engine)
        freeze_startup_heap()
        (completion,) = engine.generate([prompt], params)
    except ValueError as e:  # settings the model or machine cannot take, a prompt that does not fit: said in one line
        print(f"carpool generate: {flag_error(str(e), WorkerConfig, also=GENERATE_PARAMS)}", file=sys.stderr)
        return 2
    if config.engine.model is None:
        print(f"carpool generate: {BUILTIN_MODEL_NOTICE}", file=sys.stderr)
    print(printable(completion.text))
    return 0


async def start_engine(config: WorkerConfig) -> EngineRunner:
    """The engine in its own process (``engine_process``) or on a thread of this one; raises ``EngineStartError``."""
    engine_config = config.engine
    model = engine_config.model or "(built-in tiny model)"
    if engine_config.quantization is not None:
        model += f" with {engine_config.quantization} weights"
    if engine_config.speculative is not None:
        model += f", speculative decoding by {engine_config.speculative}"
    if config.engine_process:
        log.info("loading model %s on %s in an engine process", model, engine_config.device)
        return await EngineProcess.start(engine_config, config.torch_threads, log_settings(config))
    from worker.engine.engine import Engine

    threads = apply_torch_threads(config.torch_threads, engine_config.device)
    log.info("loading model %s on %s (%d torch threads)", model, engine_config.device, threads)
    try:
        engine = await asyncio.get_running_loop().run_in_executor(None, lambda: Engine(engine_config))
    except Exception as e:
        raise EngineStartError(f"{type(e).__name__}: {e}") from e
    freeze_startup_heap()
    return EngineThread(engine)


async def wait_for_redis(client: Any, stopped: asyncio.Event, redis_url: str) -> bool:
    """Return True once Redis answers and takes this worker's user, or False when `stopped` is set first; says
    so once in a while meanwhile. Raises `RedisRefused` when it answers but refuses the user (credentials, ACL)."""
    from scheduler.protocol.redis_client import RedisRefused, check_access, is_refusal, redacted_url, refusal_reason
    from worker.redis_errors import REDIS_ERRORS, REDIS_RETRY_S, outage_log

    outages = outage_log(log)
    while not stopped.is_set():
        try:
            await client.ping()
        except REDIS_ERRORS as e:
            if is_refusal(e):
                raise RedisRefused(refusal_reason(e)) from e
            outages.warn(f"Redis at {redacted_url(redis_url)}", e, "the worker waits for it before reading any job")
        else:
            await check_access(client)  # the check at start found it unreachable: made now
            outages.recovered()
            return True
        try:
            await asyncio.wait_for(stopped.wait(), timeout=REDIS_RETRY_S)
        except TimeoutError:
            pass
    return False


async def serve(config: WorkerConfig, telemetry_config: TelemetryConfig | None = None) -> int:
    """Run until SIGTERM/SIGINT (or a failed background task), then shut down in two phases."""
    from scheduler.protocol.redis_client import RedisRefused, check_access, redacted_url
    from scheduler.protocol.redis_client import connect as connect_redis

    from scheduler.protocol.keys import Keys
    from worker.service import WorkerNameTaken, WorkerService, check_name_is_free

    # A stop signal from the start on: one that comes while the model loads stops the worker before it takes a job
    # (as PID 1 in a container, a process without a handler would not even see it).
    loop = asyncio.get_running_loop()
    stop_asked = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_asked.set)
    # Before the model loads: wrong credentials or an ACL user without scripts are said at once, in one line.
    # And a name another live worker has, before the model loads too.
    probe = connect_redis(config.redis_url, timeout_s=config.redis_timeout_s)
    try:
        await check_access(probe)
        await check_name_is_free(probe, Keys(config.key_prefix), config.worker_name, config.heartbeat_interval_s)
    except RedisRefused as e:
        print(f"carpool worker: Redis at {redacted_url(config.redis_url)} refuses this worker: {e}", file=sys.stderr)
        return 1
    except WorkerNameTaken as e:
        print(f"carpool worker: {e}", file=sys.stderr)
        return 1
    finally:
        await probe.aclose()
    starting = asyncio.ensure_future(start_engine(config))
    stopping = asyncio.ensure_future(stop_asked.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if stop_asked.is_set():
        # An engine process being built is killed (one on a thread of this process finishes its load first: a
        # thread cannot be stopped); one built meanwhile is closed. A failed start a stop raced is no failure.
        starting.cancel()
        await asyncio.gather(starting, stopping, return_exceptions=True)
        if not starting.cancelled() and starting.exception() is None:
            await starting.result().aclose()
        log.info("stopped while the model loaded: no job was taken")
        return 0
    await asyncio.gather(stopping, return_exceptions=True)
    try:
        runner = starting.result()
    except EngineStartError as e:
        model = config.engine.model or "the built-in model"
        log.error("cannot start the engine on %s: %s", model, e)
        print(f"carpool worker: cannot start the engine on {model}: {e}", file=sys.stderr)
        return 1
    try:
        client = connect_redis(config.redis_url, max_block_ms=config.read_block_ms, timeout_s=config.redis_timeout_s)
        telemetry = Telemetry(telemetry_config or TelemetryConfig(service_name="carpool-worker"))
        service = WorkerService(config, runner, client, telemetry)
    except BaseException:
        await runner.aclose()  # the engine process goes with the worker that failed to start
        raise
    def on_signal() -> None:
        # The first signal starts the graceful drain; a second one (a second Ctrl-C) ends the wait.
        if service.stopped.is_set():
            log.warning("second signal: handing back %d running jobs now", len(service.job_loop.jobs))
            service.hand_back_now.set()
        service.stopped.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if stop_asked.is_set():  # between the engine's start and the handler above
        service.stopped.set()
    has_failed = False
    try:
        try:
            # Answering /healthz (and /readyz, 503) from here on: while Redis is waited for, a container's startup
            # probe sees a live worker, and times the model's load rather than an outage.
            if config.metrics_port:
                await service.start_http(config.metrics_host, config.metrics_port)
        except OSError as e:
            if e.errno not in LISTEN_ERRNOS:
                raise
            # Taken since the check at start.
            print(f"carpool worker: metrics server cannot listen on {config.metrics_host}:{config.metrics_port}: "
                  f"{os.strerror(e.errno)}", file=sys.stderr)
            return 1
        # Redis down when the worker starts (a cluster coming up in any order): wait for it, as for any outage.
        try:
            if not await wait_for_redis(client, service.stopped, config.redis_url):
                return 0  # stopped by a signal while waiting: nothing was taken
        except RedisRefused as e:
            print(f"carpool worker: Redis at {redacted_url(config.redis_url)} refuses this worker: {e}",
                  file=sys.stderr)
            return 1
        try:
            await service.start()
        except WorkerNameTaken as e:  # started at the same moment as another of its name: both passed the check
            print(f"carpool worker: {e}", file=sys.stderr)
            return 1
        await service.stopped.wait()
        has_failed = service.has_failed
        # Said before the drain closes the intake: a read already under way may still admit what it brings.
        log.info("stopping: closing the intake; in-flight jobs get %.1fs", config.shutdown_grace_s)
    finally:
        await service.shutdown()
        await client.aclose()
        telemetry.shutdown()
    # Jobs left unhanded-back (Redis was unavailable) wait for their lease, as a crashed worker's do; an engine that
    # died during the drain fails the process as one that died before it.
    return 1 if has_failed or service.has_failed or service.has_stranded_jobs else 0


if __name__ == "__main__":
    raise SystemExit(main())
