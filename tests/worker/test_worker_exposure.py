"""A worker's /metrics server listens on loopback unless told otherwise (containers set 0.0.0.0 themselves)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from gateway.cli.embedded_redis import free_port
from tests.harness.up_stack import REPO, carpool_env


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of the IPv4 sockets listening on `port`, from /proc/net/tcp."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip_hex, port_hex = local.split(":")
        if int(port_hex, 16) == port and state == "0A":
            addresses.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return addresses


def test_worker_metrics_bind_loopback_by_default(redis_url: str, tiny_model: Callable[..., str]) -> None:
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--redis-url", redis_url, "--model", tiny_model("llama"),
         "--metrics-port", str(port)], cwd=REPO, env=carpool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert _listen_addresses(port) == {"127.0.0.1"}
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
