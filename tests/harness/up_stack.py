"""A real `carpool up` stack in a child process, for tests of what a user sees and types."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.cli.embedded_redis import free_port
from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


def carpool_env(**extra: str) -> dict[str, str]:
    """This test run's environment without any CARPOOL_* setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    env["PYTHONPATH"] = child_pythonpath(REPO)
    env.update(extra)
    return env


def carpool(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], env=env or carpool_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


@dataclass
class UpStack:
    proc: subprocess.Popen[bytes]
    log_path: Path
    data_dir: Path
    port: int
    redis_port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.1)

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_up(tmp: Path, *args: str, env: dict[str, str] | None = None, wait: str | None = "carpool: ready") -> UpStack:
    """`carpool up` on free ports with its data in `tmp/data`; waits for `wait` in its output."""
    port, redis_port = free_port(), free_port()
    log_path = tmp / f"up-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "gateway.cli", "up", "--port", str(port), "--redis-port", str(redis_port),
             "--data-dir", str(tmp / "data"), "--worker-grace-s", "5", *args],
            cwd=REPO, env=env or carpool_env(), stdout=log, stderr=subprocess.STDOUT,
        )
    stack = UpStack(proc, log_path, tmp / "data", port, redis_port)
    if wait is not None:
        try:
            stack.wait_for(wait)
        except BaseException:
            stack.stop()
            raise
    return stack
