"""A dispatcher process killed with SIGKILL between two attempts delivers after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis

from gateway.webhooks.signing import generate_secret
from scheduler.protocol.keys import Keys
from scheduler.protocol.webhooks import delivery_fields
from tests.harness.child_env import child_pythonpath
from tests.harness.webhook_receiver import Answer, Receiver
from tests.harness.worker_harness import WAIT_S, wait_until

KEYS = Keys("whrestart")
REPO = Path(__file__).resolve().parents[3]


def start_dispatcher(redis_url: str, secret: str, log_path: Path) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "gateway.webhooks.cli", "--redis-url", redis_url, "--key-prefix", KEYS.prefix,
        "--webhook-allow", "127.0.0.1", "--webhook-retry-schedule-s", "2", "--webhook-jitter", "0",
        "--webhook-poll-s", "0.05", "--webhook-timeout-s", "2",
    ]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "CARPOOL_WEBHOOK_SECRET": secret}
    with open(log_path, "ab") as log:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


async def delivered(client: aioredis.Redis, delivery_id: str) -> bool:
    return await client.hget(KEYS.webhook_delivery(delivery_id), "state") == b"delivered"


async def test_sigkilled_dispatcher_delivers_after_restart(redis_url: str, tmp_path: Path) -> None:
    log_path = tmp_path / "dispatcher.log"
    secret = generate_secret()
    receiver = await Receiver(secret, [Answer(500)], then=Answer(200)).start()
    client = aioredis.Redis.from_url(redis_url)
    first = start_dispatcher(redis_url, secret, log_path)
    second: subprocess.Popen[bytes] | None = None
    try:
        fields = delivery_fields("job1", "completed", receiver.url, {"id": "job1"}, now=time.time())
        delivery_id = fields["id"].decode()
        await client.hset(KEYS.job("job1"), mapping={"id": "job1", "status": "succeeded"})
        await client.xadd(KEYS.webhooks, fields)  # type: ignore[arg-type]
        async def first_settled() -> bool:
            assert first.poll() is None, log_path.read_text()
            return await client.hget(KEYS.webhook_delivery(delivery_id), "state") == b"retrying"

        await wait_until(first_settled, "the first attempt settled as retrying")
        first.send_signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
        assert [r.status for r in receiver.received] == [500]
        assert await client.zscore(KEYS.webhooks_retry, delivery_id) is not None

        second = start_dispatcher(redis_url, secret, log_path)
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
        await wait_until(lambda: delivered(client, delivery_id), "the delivery settled as delivered")
        assert [r.status for r in receiver.received] == [500, 200]
        assert {r.headers["webhook-id"] for r in receiver.received} == {delivery_id}
        assert receiver.bad_signatures == 0
        assert await client.hget(KEYS.webhook_delivery(delivery_id), "state") == b"delivered"
        assert await client.hget(KEYS.job("job1"), "wh_count") == b"2"
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0, log_path.read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        await client.aclose()
        await receiver.stop()
