"""The webhook dispatcher against a real Redis and real receivers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.dispatcher import WebhookDispatcher
from gateway.webhooks.signing import generate_secret
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import Keys
from scheduler.protocol.webhooks import delivery_fields
from tests.harness.webhook_receiver import Answer, Receiver
from tests.harness.worker_harness import WAIT_S, wait_until

KEYS = Keys("whtest")


def fast_config(secret: str, **overrides: object) -> WebhookConfig:
    values: dict[str, object] = dict(
        webhook_secret=secret, webhook_allow=["127.0.0.1"], webhook_timeout_s=30.0,
        webhook_retry_schedule_s=[0.1, 0.2, 0.3], webhook_jitter=0.0, webhook_poll_s=0.02, webhook_drain_s=1.0,
    )
    values.update(overrides)
    return WebhookConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def secret() -> str:
    return generate_secret()


@pytest.fixture
async def receiver_factory(secret: str) -> AsyncIterator[Callable[..., asyncio.Future[Receiver]]]:
    started: list[Receiver] = []

    async def make(script: list[Answer] | None = None, then: Answer | None = None) -> Receiver:
        r = await Receiver(secret, script, then).start()
        started.append(r)
        return r

    yield make  # type: ignore[misc]
    for r in started:
        await r.stop()


async def enqueue(client: aioredis.Redis, job_id: str, event: str, url: str, *, text: str = "") -> str:
    """XADD one delivery the way a worker does, creating the job record if it is not there."""
    await client.hsetnx(KEYS.job(job_id), "id", job_id)
    await client.hsetnx(KEYS.job(job_id), "status", "running")
    data = {"id": job_id, "status": "running", "output": {"text": text}}
    fields = delivery_fields(job_id, event, url, data, now=time.time())
    await client.xadd(KEYS.webhooks, fields)  # type: ignore[arg-type]
    return fields["id"].decode()


async def wait_for(predicate: Callable[[], object]) -> None:
    await wait_until(predicate, "the condition")  # type: ignore[arg-type]


async def states_are(client: aioredis.Redis, delivery_ids: list[str], state: bytes) -> bool:
    return all([await client.hget(KEYS.webhook_delivery(i), "state") == state for i in delivery_ids])


async def job_attempts(client: aioredis.Redis, job_id: str) -> list[dict[str, object]]:
    return job_view(await client.hgetall(KEYS.job(job_id)))["webhooks"]


async def test_retries_until_accepted_with_one_webhook_id(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory([Answer(500), Answer(502), Answer(500)], then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        delivery_id = await enqueue(redis_client, "job1", "completed", receiver.url, text="hello")
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
        await wait_for(lambda: states_are(redis_client, [delivery_id], b"delivered"))
    assert receiver.bad_signatures == 0
    assert [r.status for r in receiver.received] == [500, 502, 500, 200]
    assert receiver.accepted_count() == 1
    assert {r.headers["webhook-id"] for r in receiver.received} == {delivery_id}
    assert len({r.body for r in receiver.received}) == 1, "every retry sends the same bytes"
    assert receiver.received[-1].payload["type"] == "completed"
    assert receiver.received[-1].payload["data"]["output"]["text"] == "hello"
    assert receiver.received[0].headers["User-Agent"].startswith("carpool-webhooks/")
    attempts = await job_attempts(redis_client, "job1")
    assert [a["attempt"] for a in attempts] == [1, 2, 3, 4]
    assert [a["outcome"] for a in attempts] == ["retrying"] * 3 + ["delivered"]
    assert [a["status_code"] for a in attempts] == [500, 502, 500, 200]
    assert all(a["delivery_id"] == delivery_id for a in attempts)
    assert attempts[0]["next_at"] is not None and attempts[-1]["next_at"] is None
    gaps = [b.at - a.at for a, b in zip(receiver.received, receiver.received[1:])]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.29, gaps
    assert await redis_client.zcard(KEYS.webhooks_retry) == 0


async def test_gone_stops_this_and_later_deliveries(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory([Answer(410)], then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        first = await enqueue(redis_client, "job1", "started", receiver.url)
        second = await enqueue(redis_client, "job1", "completed", receiver.url)
        await wait_for(lambda: states_are(redis_client, [first, second], b"gone"))
        third = await enqueue(redis_client, "job1", "completed", receiver.url)
        await wait_for(lambda: states_are(redis_client, [third], b"gone"))
    assert [r.status for r in receiver.received] == [410]
    assert receiver.received[0].headers["webhook-id"] == first
    for delivery_id in (first, second, third):
        assert await redis_client.hget(KEYS.webhook_delivery(delivery_id), "state") == b"gone"
    attempts = await job_attempts(redis_client, "job1")
    assert [(a["status_code"], a["outcome"]) for a in attempts] == [(410, "gone")]
    assert await redis_client.xlen(KEYS.webhooks_dead) == 0


async def test_silent_receiver_ends_in_dead_letter(redis_client, receiver_factory, secret) -> None:
    import json

    from tests.harness.telemetry_support import json_logs

    receiver = await receiver_factory(then=Answer(None))
    # Long enough that each attempt's body reaches the receiver (which counts it) on a loaded machine.
    config = fast_config(secret, webhook_timeout_s=1.5)
    with json_logs("gateway.webhooks", "carpool-webhooks") as stream:
        async with WebhookDispatcher(redis_client, KEYS, config):
            delivery_id = await enqueue(redis_client, "job1", "completed", receiver.url)
            await wait_for(lambda: redis_client.xlen(KEYS.webhooks_dead))
    # Each attempt's line names the job; the retries are routine (info), giving the delivery up is not.
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if delivery_id in line]
    assert [(r["level"], r["job_id"]) for r in lines] == [("info", "job1")] * 3 + [("warning", "job1")], lines
    assert len(receiver.received) == 4  # first attempt + the three retries of the schedule
    ((_, dead),) = await redis_client.xrange(KEYS.webhooks_dead)
    assert dead[b"id"].decode() == delivery_id
    assert dead[b"job_id"] == b"job1" and dead[b"attempts"] == b"4"
    assert b"timed out" in dead[b"reason"] and b"attempt 4 of 4" in dead[b"reason"]
    assert dead[b"payload"] == receiver.received[0].body
    attempts = await job_attempts(redis_client, "job1")
    assert [a["outcome"] for a in attempts] == ["retrying"] * 3 + ["dead"]
    assert all(a["status_code"] is None and "timed out" in a["error"] for a in attempts)
    assert await redis_client.hget(KEYS.webhook_delivery(delivery_id), "state") == b"dead"


async def test_retry_after_is_honoured(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory([Answer(429, {"Retry-After": "1"})], then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        await enqueue(redis_client, "job1", "started", receiver.url)
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
    assert [r.status for r in receiver.received] == [429, 200]
    assert receiver.received[1].at - receiver.received[0].at >= 0.95


@pytest.mark.parametrize("retry_after", ["0", "Thu, 01 Jan 1970 00:00:00 GMT"])
async def test_retry_after_zero_or_past_does_not_shorten_the_schedule(redis_client, receiver_factory, secret,
                                                                         retry_after: str) -> None:
    busy = Answer(503, {"Retry-After": retry_after})
    receiver = await receiver_factory([busy, busy], then=Answer(200))
    config = fast_config(secret, webhook_retry_schedule_s=[0.4, 0.8])
    async with WebhookDispatcher(redis_client, KEYS, config):
        await enqueue(redis_client, "job1", "started", receiver.url)
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
    assert [r.status for r in receiver.received] == [503, 503, 200]
    gaps = [b.at - a.at for a, b in zip(receiver.received, receiver.received[1:])]
    assert gaps[0] >= 0.39 and gaps[1] >= 0.79, gaps


REFUSED_FAST_S = 10.0
"""A refused delivery is dead within this long; with retries on the schedule below it would take minutes."""


async def test_refused_urls_are_dead_at_once_and_free_the_jobs_chain(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory(then=Answer(200))
    config = fast_config(secret, webhook_retry_schedule_s=[60.0], webhook_max_attempts=5)
    urls = {
        "job-ftp": "ftp://x/hook",
        "job-private": "http://192.168.1.1/x",
        "job-integer": f"http://2130706433:{receiver.port}/hook",  # 127.0.0.1 is allow-listed; this spelling is not
        "job-hex": f"http://0x7f000001:{receiver.port}/hook",
    }
    async with WebhookDispatcher(redis_client, KEYS, config):
        ids = {job_id: [await enqueue(redis_client, job_id, event, url) for event in ("started", "completed")]
               for job_id, url in urls.items()}
        all_ids = [i for pair in ids.values() for i in pair]
        await asyncio.wait_for(wait_for(lambda: states_are(redis_client, all_ids, b"dead")), REFUSED_FAST_S)
    assert receiver.received == []
    dead = {fields[b"id"].decode(): fields for _, fields in await redis_client.xrange(KEYS.webhooks_dead)}
    assert set(dead) == set(all_ids)
    assert all(fields[b"attempts"] == b"1" and b"refused" in fields[b"reason"] for fields in dead.values())
    assert b"scheme must be http or https" in dead[ids["job-ftp"][0]][b"reason"]
    assert b"non-public" in dead[ids["job-private"][0]][b"reason"]
    assert b"dotted-decimal" in dead[ids["job-integer"][0]][b"reason"]
    for job_id in urls:
        attempts = await job_attempts(redis_client, job_id)
        assert [(a["event"], a["attempt"], a["outcome"]) for a in attempts] == [
            ("started", 1, "dead"), ("completed", 1, "dead")]
        assert all(a["error"].startswith("refused: ") and a["next_at"] is None for a in attempts)
    assert await redis_client.zcard(KEYS.webhooks_retry) == 0


async def test_one_jobs_events_arrive_in_order(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory([Answer(500), Answer(500)], then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        ids = [await enqueue(redis_client, "job1", "started", receiver.url)]
        ids += [await enqueue(redis_client, "job1", "output", receiver.url, text="ab"[: i + 1]) for i in range(2)]
        ids.append(await enqueue(redis_client, "job1", "completed", receiver.url, text="ab"))
        await wait_for(lambda: receiver.accepted_count() == 4)
    accepted = [r for r in receiver.received if r.status == 200]
    assert [r.headers["webhook-id"] for r in accepted] == ids
    assert [r.payload["type"] for r in accepted] == ["started", "output", "output", "completed"]
    assert len(receiver.received) == 6 and receiver.received[0].payload["type"] == "started"


async def test_two_dispatchers_never_send_one_attempt_twice(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory(then=Answer(200))
    config = fast_config(secret)
    async with WebhookDispatcher(redis_client, KEYS, config), WebhookDispatcher(redis_client, KEYS, config):
        ids = [await enqueue(redis_client, f"job{i}", "completed", receiver.url) for i in range(30)]
        await wait_for(lambda: states_are(redis_client, ids, b"delivered"))
    assert sorted(r.headers["webhook-id"] for r in receiver.received) == sorted(ids)


async def has_two_dead(client: aioredis.Redis) -> bool:
    return await client.xlen(KEYS.webhooks_dead) >= 2


async def test_non_public_url_is_refused_at_delivery_without_traffic(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory(then=Answer(200))
    config = fast_config(secret, webhook_allow=[], webhook_retry_schedule_s=[0.05], webhook_max_attempts=2)
    async with WebhookDispatcher(redis_client, KEYS, config):
        await enqueue(redis_client, "job1", "completed", f"http://localhost:{receiver.port}/hook")
        await enqueue(redis_client, "job2", "completed", receiver.url)
        await wait_for(lambda: has_two_dead(redis_client))
    assert receiver.received == []
    for job_id in ("job1", "job2"):
        attempts = await job_attempts(redis_client, job_id)
        assert [a["outcome"] for a in attempts] == ["dead"], "no retry can change a refusal"
        assert all("refused" in a["error"] and "non-public" in a["error"] for a in attempts)


async def test_bad_stream_entry_is_dead_lettered_and_others_still_go(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory(then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        await redis_client.xadd(KEYS.webhooks, {"id": "msg_x", "job_id": "job1", "event": "started"})
        await enqueue(redis_client, "job2", "completed", receiver.url)
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
    ((_, dead),) = await redis_client.xrange(KEYS.webhooks_dead)
    assert dead[b"reason"] == b"invalid webhook delivery entry: missing field url"
    assert receiver.accepted_count() == 1


async def test_entries_with_fields_that_are_not_utf8_are_dead_lettered_and_the_rest_go(
        redis_client, receiver_factory, secret) -> None:
    """A delivery due in the same round as a garbled one still goes: the garbled ones never reach a round."""
    receiver = await receiver_factory(then=Answer(200))
    fields = [delivery_fields(f"bad{i}", "completed", receiver.url, {"id": f"bad{i}"}, now=time.time())
              for i in range(5)]
    fields[0]["url"] = receiver.url.encode() + b"/\xff\xfe"
    fields[1]["id"] = b"msg_\xff"
    fields[2]["job_id"] = b"\xed\xa0\x80"  # a UTF-16 surrogate, which Python's decoder refuses
    fields[3]["event"] = b"\xc0\xaf"  # an overlong form
    fields[4]["traceparent"] = b"00-\xff"
    for f in fields:
        await redis_client.xadd(KEYS.webhooks, f)  # type: ignore[arg-type]
    good = [await enqueue(redis_client, f"job{i}", "completed", receiver.url, text="caf\u00e9 \U0001f600")
            for i in range(3)]
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        await wait_for(lambda: states_are(redis_client, good, b"delivered"))
    reasons = sorted(dead[b"reason"].decode() for _, dead in await redis_client.xrange(KEYS.webhooks_dead))
    assert reasons == sorted(f"invalid webhook delivery entry: field {name} is not UTF-8 text"
                             for name in ("url", "id", "job_id", "event", "traceparent"))
    assert sorted(r.headers["webhook-id"] for r in receiver.received) == sorted(good)


async def test_without_secret_nothing_is_taken_off_the_queue(redis_client, receiver_factory, secret) -> None:
    receiver = await receiver_factory(then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(None)) as dispatcher:  # type: ignore[arg-type]
        await enqueue(redis_client, "job1", "completed", receiver.url)
        await wait_for(lambda: dispatcher.task is not None and dispatcher.task.done())
    assert receiver.received == [] and await redis_client.xlen(KEYS.webhooks) == 1


async def test_a_stored_delivery_with_a_field_that_is_not_utf8_is_dead_lettered_and_its_chain_goes_on(
        redis_client, receiver_factory, secret) -> None:
    """A delivery stored before ingest refused such fields (an older version): it cannot be sent; it ends dead
    and the job's next delivery, queued behind it on the job's chain, still goes."""
    receiver = await receiver_factory(then=Answer(200))
    job = b"job-1"
    bad, good = b"msg_bad", b"msg_good"
    url = receiver.url.encode()
    for delivery_id, event, target in ((bad, b"started", url + b"/\xfe"), (good, b"completed", url)):
        await redis_client.hset(KEYS.webhook_delivery("").encode() + delivery_id, mapping={
            "id": delivery_id, "job_id": job, "event": event, "url": target, "payload": b'{"type": "x"}',
            "created_at": time.time(), "attempts": 0, "state": "pending", "traceparent": ""})
        await redis_client.rpush(KEYS.webhook_chain("").encode() + job, delivery_id)
    await redis_client.zadd(KEYS.webhooks_retry, {bad: time.time()})
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
    assert [r.headers["webhook-id"] for r in receiver.received] == ["msg_good"]
    ((_, dead),) = await redis_client.xrange(KEYS.webhooks_dead)
    assert dead[b"id"] == bad and b"not UTF-8" in dead[b"reason"]
    assert await redis_client.hget(KEYS.webhook_delivery("").encode() + bad, "state") == b"dead"


async def test_a_dead_letter_is_replayed_under_its_own_webhook_id(redis_client, redis_url, receiver_factory,
                                                                  secret, capsys) -> None:
    """`carpool webhooks --replay-dead` puts a dead-lettered delivery back on the stream under its own id (the
    receiver's dedupe knows it), and the dispatcher sends it; the dead stream's record of a malformed stream entry
    stays, an id not there is said, and a second replay finds nothing."""
    from gateway.webhooks.cli import main as webhooks_main

    receiver = await receiver_factory(script=[Answer(500)] * 4, then=Answer(200))
    async with WebhookDispatcher(redis_client, KEYS, fast_config(secret)):
        delivery_id = await enqueue(redis_client, "job1", "completed", receiver.url)
        await redis_client.xadd(KEYS.webhooks, {"id": "msg_x", "job_id": "job1", "event": "started"})
        await wait_for(lambda: _dead_count(redis_client, 2))
        assert receiver.accepted_count() == 0
        argv = ["--redis-url", redis_url, "--key-prefix", KEYS.prefix, "--replay-dead"]
        assert await asyncio.to_thread(webhooks_main, [*argv, f"{delivery_id},msg_nowhere"]) == 1
        out, err = capsys.readouterr()
        assert out == f"replayed 1 dead-lettered delivery: {delivery_id}\n"
        assert "not in whtest:webhooks:dead as dead deliveries: msg_nowhere" in err
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
    assert [r.headers["webhook-id"] for r in receiver.received] == [delivery_id] * 5
    assert receiver.received[-1].body == receiver.received[0].body
    ((_, left),) = await redis_client.xrange(KEYS.webhooks_dead)
    assert left[b"reason"] == b"invalid webhook delivery entry: missing field url"
    assert await asyncio.to_thread(webhooks_main, [*argv, "all"]) == 0
    assert capsys.readouterr().out == "replayed 0 dead-lettered deliveries\n"


async def _dead_count(client: aioredis.Redis, n: int) -> bool:
    return await client.xlen(KEYS.webhooks_dead) >= n
