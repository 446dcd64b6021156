"""`carpool worker` started with a malformed setting, as a container's environment can give it: one line
naming the setting, exit 2, before any model is loaded; never a traceback or a process left hanging."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("variable", "value", "word"), [
    ("CARPOOL_REDIS_URL", "http://redis:6379/0", "redis_url"),
    ("CARPOOL_REDIS_URL", "redis://:pw@redis:port/0", "redis_url"),
    ("CARPOOL_KEY_PREFIX", "", "key_prefix"),
    ("CARPOOL_LOG_LEVEL", "chatty", "log_level"),
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
