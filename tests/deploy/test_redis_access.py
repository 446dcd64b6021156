"""A Redis that refuses carpool's user for good (wrong credentials, an ACL without a command carpool needs):
each process says so in one line and exits 1 at start, and a worker that meets a refused command once it
runs stops rather than spend every job's deliveries on it. An outage, which is waited out, is not that."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis

from gateway.cli.embedded_redis import EmbeddedRedis
from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from tests.harness.child_env import child_pythonpath
from tests.harness.worker_harness import KEYS, running_worker, wait_until, xadd_job

REPO = Path(__file__).resolve().parents[2]
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A Redis of this module's own, with users that may not run scripts, or publish."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("acl-redis"), is_persistent=False).start()
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    admin.execute_command("ACL", "SETUSER", "nopublish", "on", ">pw", "~*", "&*", "+@all", "-publish")
    admin.execute_command("ACL", "SETUSER", "noxadd", "on", ">pw", "~*", "&*", "+@all", "-xadd")
    admin.close()
    yield server
    server.stop()


def as_user(server: EmbeddedRedis, user: str, password: str) -> str:
    """The server's URL as `user`, or (user `default` without a password) with a database past its 16."""
    if user == "default" and not password:
        return server.url.rsplit("/", 1)[0] + "/99"
    return server.url.replace("redis://", f"redis://{user}:{password}@", 1)


@pytest.mark.parametrize("process", ["gateway", "worker", "webhooks"])
@pytest.mark.parametrize(("user", "password", "words"), [
    ("noscripts", "wrong", "invalid username-password pair"),
    ("noscripts", "pw", "no permissions to run the 'script' command"),
    ("default", "", "DB index is out of range"),  # a database number past the server's: the URL's /99
])
def test_a_process_refused_by_redis_says_so_in_one_line_and_exits_1(acl_redis: EmbeddedRedis, tiny_model,
                                                                     process: str, user: str, password: str,
                                                                     words: str) -> None:
    flags = {"gateway": ["--port", "0"], "worker": ["--model", tiny_model()], "webhooks": ["--webhook-secret", SECRET]}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env.update(PYTHONPATH=child_pythonpath(REPO), CARPOOL_METRICS_PORT="0", OTEL_TRACES_EXPORTER="none",
               OTEL_METRICS_EXPORTER="none")
    done = subprocess.run([sys.executable, "-m", "gateway.cli", process, *flags[process],
                           "--redis-url", as_user(acl_redis, user, password)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    # One line, and before the worker loads its model (which it would log first).
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith(f"carpool {process}: Redis at redis://") and words in line, line
    if password:
        assert line.startswith(f"carpool {process}: Redis at redis://{user}:***@") and f":{password}@" not in line


async def test_a_worker_whose_user_may_not_publish_stops_at_its_first_entry_and_spends_no_delivery(
        acl_redis: EmbeddedRedis, tiny_model) -> None:
    """Its scripts run, so it starts; the first admission publishes the job's start and is refused: the worker
    stops, exiting non-zero, and the job waits for another worker, neither failed nor dead-lettered."""
    from worker.engine.engine import Engine

    admin = aioredis.Redis.from_url(acl_redis.url)
    await admin.flushall()
    entry_id = await xadd_job(admin, JobSpec(id="waits", prompt="x", params=SamplingParams(max_tokens=2)))
    async with running_worker(as_user(acl_redis, "nopublish", "pw"), Engine(model=tiny_model(), max_num_seqs=2),
                              max_deliveries=1) as service:
        await wait_until(lambda: service.stopped.is_set(), "the worker stopping")
        assert service.has_failed
    (pending,) = await admin.xpending_range(KEYS.lane("standard"), CONSUMER_GROUP, "-", "+", 10)
    assert pending["message_id"].decode() == entry_id  # to be redelivered after its lease
    assert await admin.xlen(KEYS.dead) == 0 and await admin.hget(KEYS.job("waits"), "status") != b"failed"
    await admin.aclose()


async def test_a_gateway_refused_a_command_while_it_runs_answers_503_naming_it(acl_redis: EmbeddedRedis) -> None:
    """Scripts run (so it starts) but the enqueue script's XADD is refused: a 503 that says why, in each route's
    shape, rather than a 500."""
    from gateway.app import init_app
    from gateway.config import GatewayConfig
    from tests.harness.gateway_server import GatewayTestServer

    with redis.Redis.from_url(acl_redis.url) as admin:
        admin.flushall()
    config = GatewayConfig(redis_url=as_user(acl_redis, "noxadd", "pw"), no_webhooks=True)
    async with GatewayTestServer(init_app(config)) as server, aiohttp.ClientSession() as http:
        async with http.post(server.make_url("/v1/jobs"), json={"prompt": "x"}) as resp:
            body = await resp.json()
            assert resp.status == 503 and body["error"]["type"] == "unavailable", body
            assert "refuses this gateway's user a command it needs" in body["error"]["message"], body
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        async with http.post(server.make_url("/v1/chat/completions"), json=chat) as resp:
            body = await resp.json()
            assert resp.status == 503 and "refuses this gateway's user" in body["error"]["message"], body


def test_a_worker_started_before_a_redis_that_refuses_it_exits_1_once_it_is_up(tiny_model, tmp_path: Path) -> None:
    """Waiting for Redis is for an outage: once Redis answers and refuses the worker's user, the worker says so
    in one line and exits, as it does when Redis is up first."""
    from gateway.cli.embedded_redis import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env.update(PYTHONPATH=child_pythonpath(REPO), CARPOOL_METRICS_PORT="0", OTEL_TRACES_EXPORTER="none",
               OTEL_METRICS_EXPORTER="none")
    worker = subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker", "--model", tiny_model(),
                               "--redis-url", f"redis://noscripts:pw@127.0.0.1:{port}/0"],
                              env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        deadline = time.monotonic() + 120
        assert worker.stderr is not None
        for line in worker.stderr:  # the model loads, then the worker waits for Redis
            if "the worker waits for it before reading any job" in line:
                break
            assert time.monotonic() < deadline and worker.poll() is None, line
        server = EmbeddedRedis(tmp_path / "redis", port=port, is_persistent=False).start()
        with redis.Redis.from_url(server.url) as admin:
            admin.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
        _, err = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if server is not None:
            server.stop()
    assert worker.returncode == 1 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("carpool worker:")]
    assert line.startswith("carpool worker: Redis at redis://noscripts:***@") and "refuses this worker" in line, line
