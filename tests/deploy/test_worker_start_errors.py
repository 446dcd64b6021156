"""`carpool worker` started with a malformed setting, as a container's environment can give it: one line
naming the setting, exit 2, before any model is loaded; never a traceback or a process left hanging."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("variable", "value", "word"), [
    ("CARPOOL_REDIS_URL", "http://redis:6379/0", "--redis-url (CARPOOL_REDIS_URL): "),
    ("CARPOOL_REDIS_URL", "redis://:pw@redis:port/0", "--redis-url (CARPOOL_REDIS_URL): "),
    ("CARPOOL_KEY_PREFIX", "", "--key-prefix (CARPOOL_KEY_PREFIX): "),
    ("CARPOOL_LOG_LEVEL", "chatty", "--log-level (CARPOOL_LOG_LEVEL): "),
])
def test_worker_refuses_a_bad_setting_at_once(variable: str, value: str, word: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env.update(PYTHONPATH=child_pythonpath(REPO), CARPOOL_METRICS_PORT="0", OTEL_TRACES_EXPORTER="none",
               OTEL_METRICS_EXPORTER="none", **{variable: value})
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "worker"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("carpool worker: ") and word in lines[0], done.stderr
    assert "pw@" not in done.stderr  # a password in the URL is not echoed back


def _worker(**variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env.update(PYTHONPATH=child_pythonpath(REPO), **variables)
    return subprocess.run([sys.executable, "-m", "gateway.cli", "worker"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_a_bad_telemetry_variable_is_one_line_and_exit_2() -> None:
    done = _worker(CARPOOL_METRICS_PORT="0", OTEL_TRACES_EXPORTER="jaeger")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("carpool worker: OTEL_TRACES_EXPORTER"), line


def test_a_taken_metrics_port_ends_the_worker_before_its_model_loads(tiny_model: Callable[..., str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _worker(CARPOOL_METRICS_PORT=str(port), CARPOOL_METRICS_HOST="127.0.0.1", OTEL_TRACES_EXPORTER="none",
                       OTEL_METRICS_EXPORTER="none", CARPOOL_MODEL=tiny_model())
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    # One line and no other: loading the model would have logged "loading model ..." first.
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line == f"carpool worker: metrics server cannot listen on 127.0.0.1:{port}: Address already in use", line
