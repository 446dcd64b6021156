"""`carpool up`'s Redis is where the README's examples look: port 6379 by default, its URL in the
data dir, and `carpool redis-cli` (the bundled binary) pointed at it."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import redis

from gateway.cli.main import build_parser
from gateway.cli.up import UpConfig
from scheduler.runtime.flags import config_from_args
from tests.harness.up_stack import UpStack, carpool, carpool_env, start_up


def test_up_takes_the_standard_redis_port_by_default() -> None:
    up = config_from_args(UpConfig, build_parser({}).parse_args(["up"]))
    assert up.redis_port == 6379


@pytest.fixture(scope="module")
def stack(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    up = start_up(tmp_path_factory.mktemp("up"), "--model", tiny_model("llama"))
    yield up
    assert up.stop() == 0, up.log()


def _wait_status(client: redis.Redis, job_id: str, timeout_s: float = 120) -> bytes | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.hget(f"carpool:job:{job_id}", "status")
        if status in (b"succeeded", b"failed"):
            return status
        time.sleep(0.1)
    return client.hget(f"carpool:job:{job_id}", "status")


@pytest.mark.slow
def test_readme_redis_examples_reach_the_stack(stack: UpStack) -> None:
    url_file = stack.data_dir / "redis.url"
    assert url_file.read_text().strip() == stack.redis_url
    env = carpool_env(CARPOOL_DATA_DIR=str(stack.data_dir))
    job = {"v": 1, "id": "nightly-0001", "prompt": "Summarise: …", "params": {"max_tokens": 4}, "reply_to": "nightly-results"}
    added = carpool("redis-cli", "XADD", "carpool:lane:batch", "*", "job", json.dumps(job), env=env)
    assert added.returncode == 0 and "-" in added.stdout, added.stderr
    client = redis.Redis.from_url(url_file.read_text().strip())
    try:
        assert _wait_status(client, "nightly-0001") == b"succeeded", stack.log()
        status = carpool("redis-cli", "HGET", "carpool:job:nightly-0001", "status", env=env)
        assert status.stdout.strip() == "succeeded"
        client.xadd("carpool:lane:standard", {"job": msgpack.packb(
            {"v": 1, "id": "doc-17", "messages": [{"role": "user", "content": "Hi!"}],
             "params": {"max_tokens": 4, "temperature": 0}})})
        assert _wait_status(client, "doc-17") == b"succeeded"
    finally:
        client.close()


def test_the_redis_cli_that_up_names_reaches_its_redis_as_pasted(stack: UpStack) -> None:
    """The data dir is not the default one here, so the command `carpool up` prints names it."""
    [hint] = re.findall(r"`(carpool redis-cli[^`]*)` talks to it", stack.log())
    assert "--data-dir" in hint
    pong = carpool(*shlex.split(hint)[1:], "PING")
    assert (pong.returncode, pong.stdout.strip()) == (0, "PONG"), pong.stderr


@pytest.mark.slow
def test_a_taken_redis_port_is_refused_at_once(stack: UpStack, tmp_path: Path) -> None:
    second = carpool("up", "--redis-port", str(stack.redis_port), "--port", "0", "--data-dir", str(tmp_path), timeout_s=60)
    assert second.returncode == 1
    assert f"port {stack.redis_port} is in use" in second.stderr
    assert "Traceback" not in second.stderr


@pytest.mark.slow
def test_a_second_up_on_the_same_data_dir_is_refused(stack: UpStack) -> None:
    second = start_up(stack.data_dir.parent, "--redis-port", "0", wait=None)  # the same data dir, other ports
    try:
        code = second.proc.wait(timeout=60)
    finally:
        second.stop()
    assert code == 1, second.log()
    assert f"another carpool up (pid {stack.proc.pid}) is running with its Redis data in {stack.data_dir}" in second.log()
    assert stack.proc.poll() is None  # the first one runs on


@pytest.mark.slow
def test_up_says_so_when_its_worker_waits_for_a_redis_that_does_not_answer(tmp_path: Path) -> None:
    """`--redis-url` naming a Redis that is down: once the model is loaded, up's own output says that the worker
    waits for it (where before nothing did), and a stop meanwhile ends up cleanly."""
    from gateway.cli.embedded_redis import free_port

    url = f"redis://:pw-xq7z@127.0.0.1:{free_port()}/0"
    stack = start_up(tmp_path, "--redis-url", url, wait="carpool: waiting")
    try:
        said = stack.log()
        assert f"it waits for Redis at redis://:***@127.0.0.1:" in said, said
        assert "pw-xq7z" not in said and "Traceback" not in said
    finally:
        code = stack.stop()
    assert code == 0, stack.log()
