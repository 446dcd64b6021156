"""`carpool gateway` and `carpool webhooks` as an operator starts them: a bad setting or a port in use
is one clear line on stderr and a non-zero exit, never a traceback, and no log line shows a password."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.cli.embedded_redis import free_port
from gateway.webhooks.signing import generate_secret
from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env["PYTHONPATH"] = child_pythonpath(REPO)
    env["OTEL_TRACES_EXPORTER"] = env["OTEL_METRICS_EXPORTER"] = "none"
    env.update(extra)
    return env


def _carpool(*args: str, env: dict[str, str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def _one_line_refusal(done: subprocess.CompletedProcess[str], prog: str, *words: str) -> str:
    """The process exited non-zero with a single plain line on stderr (beside any JSON log lines) naming its
    verb and ``words``."""
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("usage:", " ", "{"))]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: "), done.stderr
    for word in words:
        assert word in lines[0], done.stderr
    return lines[0]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A 127.0.0.1 port some other program is listening on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_gateway_port_in_use_is_one_line(redis_url: str, held_port: int) -> None:
    done = _carpool("gateway", "--port", str(held_port), "--redis-url", redis_url, env=_env())
    _one_line_refusal(done, "carpool gateway", str(held_port))


@pytest.mark.parametrize("verb", ["gateway", "webhooks"])
def test_unknown_log_level_is_refused(verb: str, redis_url: str) -> None:
    env = _env(CARPOOL_WEBHOOK_SECRET=generate_secret(), CARPOOL_METRICS_PORT="0")
    done = _carpool(verb, "--log-level", "loud", "--port" if verb == "gateway" else "--metrics-port",
                    str(free_port()) if verb == "gateway" else "0", "--redis-url", redis_url, env=env, timeout_s=15)
    assert done.returncode == 2
    _one_line_refusal(done, f"carpool {verb}", "loud")


def test_a_bad_variable_of_another_verb_does_not_stop_this_one(redis_url: str) -> None:
    # A worker's setting in a shared environment is none of `carpool keys`' business.
    done = _carpool("keys", "list", "--redis-url", redis_url, env=_env(CARPOOL_MAX_NUM_SEQS="lots"))
    assert done.returncode == 0, done.stderr


def test_a_bad_variable_is_reported_by_the_verb_that_reads_it() -> None:
    done = _carpool("gateway", env=_env(CARPOOL_PORT="eighty"))
    assert done.returncode == 2
    _one_line_refusal(done, "carpool gateway", "CARPOOL_PORT")
    # Read by the worker and by generate: the verb being run says so, not another that reads it too.
    done = _carpool("generate", "hi", env=_env(CARPOOL_BLOCK_SIZE="abc"))
    assert done.returncode == 2
    _one_line_refusal(done, "carpool generate", "CARPOOL_BLOCK_SIZE='abc'")


@pytest.mark.parametrize(("flag", "value", "word"), [
    ("--max-tokens", "0", "--max-tokens: "), ("--temperature", "-1", "--temperature: "), ("--top-p", "2", "--top-p: "),
    ("--seed", "-5", "--seed: ")])
def test_generate_refuses_bad_sampling_flags_in_one_line(flag: str, value: str, word: str) -> None:
    done = _carpool("generate", "hi", flag, value, env=_env())
    assert done.returncode == 2
    _one_line_refusal(done, "carpool generate", word)


@pytest.mark.parametrize(("flag", "value", "word"), [
    ("--redis-url", "http://127.0.0.1:6379/0", "--redis-url: "),
    ("--redis-url", "redis://127.0.0.1:notaport/0", "--redis-url: "),
    ("--key-prefix", "", "--key-prefix: "),
    ("--key-prefix", "two words", "--key-prefix: "),
])
def test_webhooks_refuses_bad_settings(flag: str, value: str, word: str) -> None:
    env = _env(CARPOOL_WEBHOOK_SECRET=generate_secret())
    done = _carpool("webhooks", "--metrics-port", "0", flag, value, env=env, timeout_s=15)
    assert done.returncode == 2
    _one_line_refusal(done, "carpool webhooks", word)


def test_webhooks_metrics_port_in_use_is_one_line(redis_url: str, held_port: int) -> None:
    env = _env(CARPOOL_WEBHOOK_SECRET=generate_secret(), CARPOOL_METRICS_HOST="127.0.0.1")
    done = _carpool("webhooks", "--metrics-port", str(held_port), "--redis-url", redis_url, env=env)
    _one_line_refusal(done, "carpool webhooks", str(held_port))


def test_webhooks_never_logs_the_redis_password(redis_url: str, tmp_path: Path) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "hooks", "on", ">s3cret-pw", "~*", "&*", "+@all")
    admin.close()
    url = redis_url.replace("redis://", "redis://hooks:s3cret-pw@")
    env = _env(CARPOOL_WEBHOOK_SECRET=generate_secret(), CARPOOL_LOG_LEVEL="debug")
    log_path = tmp_path / "webhooks.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "webhooks", "--metrics-port", "0",
                                 "--redis-url", url], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "running on" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    out = log_path.read_text()
    assert "s3cret-pw" not in out, out
    assert "hooks:***@127.0.0.1" in out, out  # still says which server and user
