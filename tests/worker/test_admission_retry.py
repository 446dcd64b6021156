"""An admission retried after Redis dropped the reply to a START that it did run: the job still counts one
attempt and its ``started`` webhook is still queued."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from scheduler.protocol.lanes import Lane
from tests.harness.redis_proxy import RedisProxy
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, wait_until


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


async def test_a_start_whose_reply_was_lost_is_not_a_second_attempt(redis_url, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    proxy = await RedisProxy(redis_url).start()
    body = {"v": 1, "id": "lost-reply", "prompt": "x", "params": {"max_tokens": 4, "temperature": 0},
            "webhook": {"url": "http://192.168.1.1/x", "events": ["started", "completed"]}}
    try:
        async with running_worker(proxy.url, engine, lease_s=10.0):
            # A first job loads START into Redis's script cache, so that the next EVALSHA runs it.
            await client.xadd(KEYS.lane(Lane.STANDARD), {"job": json.dumps({**body, "id": "first", "webhook": None})})
            await wait_terminal(client, ["first"])
            # Only START carries the job's cancel flag key: Redis runs it, then its reply is lost with the connection.
            proxy.trip(KEYS.cancel("lost-reply").encode())
            await client.xadd(KEYS.lane(Lane.STANDARD), {"job": json.dumps(body)})
            await wait_until(lambda: proxy.num_tripped == 1 and proxy.is_down, "the job's START run with its reply lost")
            proxy.restore()
            views = await wait_terminal(client, ["lost-reply"])
            await wait_until(lambda: client.xlen(KEYS.webhooks), "the job's callbacks queued")
    finally:
        await proxy.aclose()
    view = views["lost-reply"]
    assert view["status"] == "succeeded"
    events = [fields[b"event"] for _, fields in await client.xrange(KEYS.webhooks)]
    await client.aclose()
    assert (view["attempts"], events) == (1, [b"started", b"completed"])
