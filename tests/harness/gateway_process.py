"""A real gateway process (`python -m gateway.cli gateway`) for tests that load it from outside."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.child_env import child_pythonpath, stop_process

REPO = Path(__file__).resolve().parents[2]


@dataclass
class GatewayProcess:
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_fd_limit(wanted: int) -> None:
    """Lift this process's soft file-descriptor limit towards `wanted` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@contextmanager
def gateway_process(redis_url: str, log_path: Path, *flags: str, ready_timeout_s: float = 30.0) -> Iterator[GatewayProcess]:
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "gateway", "--redis-url", redis_url, "--port", str(port),
            "--no-webhooks", "--log-level", "INFO", *flags]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"gateway did not start:\n{log_path.read_text(errors='replace')}") from None
                time.sleep(0.1)
        yield GatewayProcess(url, log_path, proc)
    finally:
        stop_process(proc)
