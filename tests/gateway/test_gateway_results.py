"""Long-poll, server-sent events and cancellation, with the test playing the worker's part in Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway import appkeys
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import Keys
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import WAIT_S, wait_until

KEYS = Keys()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    webhooks = WebhookConfig(webhook_secret=generate_secret(), webhook_allow=["hooks.test"])
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, sse_heartbeat_s=0.5, webhooks=webhooks)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        yield client


async def new_job(client: TestClient, **body: Any) -> str:
    resp = await client.post("/v1/jobs", json={"prompt": "hello", **body})
    assert resp.status == 202
    return str((await resp.json())["id"])


async def finish_like_a_worker(redis: aioredis.Redis, job_id: str, text: str, delay_s: float) -> None:
    """What a worker does at the end of a job: write the result, then publish the final event."""
    await asyncio.sleep(delay_s)
    now = time.time()
    await redis.hset(KEYS.job(job_id), mapping={
        "status": "succeeded", "started_at": repr(now - 0.2), "first_token_at": repr(now - 0.1),
        "finished_at": repr(now), "worker": "w-test",
        "output": msgpack.packb({"text": text, "token_ids": [1, 2], "finish_reason": "length"}),
    })
    view = job_view(await redis.hgetall(KEYS.job(job_id)))
    await redis.publish(KEYS.events(job_id), msgpack.packb({"type": "final", "id": job_id, "job": view}))


async def test_long_poll_returns_when_the_job_finishes(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)
    poll = asyncio.create_task(client.get(f"/v1/jobs/{job_id}?wait=60"))
    await wait_until(lambda: client.app[appkeys.HUB].num_waiters == 1, "the long poll waiting")
    assert not poll.done()  # it waits for the job rather than answering with the queued record
    await finish_like_a_worker(redis, job_id, "done!", delay_s=0)
    finished = time.monotonic()
    view = await (await poll).json()
    assert view["status"] == "succeeded"
    assert view["output"]["text"] == "done!"
    assert view["worker"] == "w-test"
    assert view["timings"]["e2e_s"] is not None
    assert time.monotonic() - finished < 30  # answered on the final event, not when its 60 s wait ran out


async def test_long_poll_gives_the_current_record_after_the_wait(client: TestClient) -> None:
    job_id = await new_job(client)
    started = time.monotonic()
    view = await (await client.get(f"/v1/jobs/{job_id}?wait=0.4")).json()
    assert view["status"] == "queued"
    assert 0.35 < time.monotonic() - started < 30  # it waited, and answered when the wait ended (not at max_wait_s)


async def test_many_long_polls_share_one_subscription(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)
    polls = [asyncio.create_task(client.get(f"/v1/jobs/{job_id}?wait=60")) for _ in range(5)]
    await wait_until(lambda: client.app[appkeys.HUB].num_waiters == 5, "all 5 long polls waiting")
    assert (await redis.pubsub_numsub(KEYS.events(job_id)))[0][1] == 1
    await finish_like_a_worker(redis, job_id, "all", delay_s=0)
    views = [await (await poll).json() for poll in polls]
    assert [v["status"] for v in views] == ["succeeded"] * 5
    await wait_until(lambda: unsubscribed(redis, KEYS.events(job_id)), "the shared subscription dropped")


async def unsubscribed(redis: aioredis.Redis, channel: str) -> bool:
    return (await redis.pubsub_numsub(channel))[0][1] == 0


async def read_sse(client: TestClient, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    resp = await client.get(f"/v1/jobs/{job_id}/events")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[len("data: "):])))
    return events


async def test_sse_relays_started_tokens_and_final(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)

    async def worker() -> None:
        channel = KEYS.events(job_id)
        while (await redis.pubsub_numsub(channel))[0][1] == 0:
            await asyncio.sleep(0.02)
        await redis.publish(channel, msgpack.packb({"type": "started", "id": job_id, "worker": "w-test"}))
        await redis.publish(channel, b"\xc1 not msgpack")  # garbage on the channel is skipped
        for index, (text, token) in enumerate([("he", 5), ("llo", 6)], start=1):
            await redis.publish(channel, msgpack.packb(
                {"type": "token", "id": job_id, "text": text, "token_ids": [token], "index": index}))
        await finish_like_a_worker(redis, job_id, "hello", delay_s=0)

    task = asyncio.create_task(worker())
    events = await asyncio.wait_for(read_sse(client, job_id), WAIT_S)
    await task
    assert [kind for kind, _ in events] == ["started", "token", "token", "final"]
    assert "".join(data["text"] for kind, data in events if kind == "token") == "hello"
    assert events[2][1]["token_ids"] == [6] and events[2][1]["index"] == 2
    assert events[-1][1]["job"]["status"] == "succeeded"
    assert events[-1][1]["job"]["output"]["text"] == "hello"


async def test_sse_of_a_finished_job_replays_it_at_once(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)
    await finish_like_a_worker(redis, job_id, "old news", delay_s=0)
    events = await asyncio.wait_for(read_sse(client, job_id), WAIT_S)
    assert [kind for kind, _ in events] == ["started", "token", "final"]
    assert events[1][1]["text"] == "old news" and events[1][1]["token_ids"] == [1, 2] and events[1][1]["index"] == 0
    assert events[-1][1]["job"]["output"]["text"] == "old news"


async def test_sse_notices_a_missed_final_on_its_heartbeat(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)

    async def finish_silently() -> None:
        while (await redis.pubsub_numsub(KEYS.events(job_id)))[0][1] == 0:
            await asyncio.sleep(0.02)
        await redis.hset(KEYS.job(job_id), mapping={"status": "failed", "finished_at": repr(time.time())})

    task = asyncio.create_task(finish_silently())
    events = await asyncio.wait_for(read_sse(client, job_id), WAIT_S)
    await task
    assert [(kind, data["job"]["status"]) for kind, data in events] == [("final", "failed")]


async def test_cancel_a_queued_job(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client, reply_to="replies", webhook={"url": "https://hooks.test/cb", "events": ["completed"]})
    waiter = asyncio.create_task(client.get(f"/v1/jobs/{job_id}?wait=60"))
    await wait_until(lambda: client.app[appkeys.HUB].num_waiters == 1, "the long poll waiting")

    resp = await client.delete(f"/v1/jobs/{job_id}")
    assert resp.status == 202
    view = await resp.json()
    assert view["status"] == "cancelled" and view["error"]["type"] == "cancelled"
    assert (await (await waiter).json())["status"] == "cancelled"

    record = await redis.hgetall(KEYS.job(job_id))
    assert record[b"status"] == b"cancelled" and float(record[b"finished_at"]) > 0
    assert await redis.get(KEYS.cancel(job_id)) == b"1"
    replies = await redis.xrange("replies")
    assert len(replies) == 1 and msgpack.unpackb(replies[0][1][b"result"])["status"] == "cancelled"
    deliveries = await redis.xrange(KEYS.webhooks)
    assert len(deliveries) == 1
    assert deliveries[0][1][b"event"] == b"completed" and deliveries[0][1][b"url"] == b"https://hooks.test/cb"
    assert json.loads(deliveries[0][1][b"payload"])["data"]["status"] == "cancelled"

    again = await client.delete(f"/v1/jobs/{job_id}")
    assert again.status == 409
    assert await redis.xlen(KEYS.webhooks) == 1  # the loser delivers nothing


async def test_cancel_a_running_job_asks_its_worker(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)
    await redis.hset(KEYS.job(job_id), mapping={"status": "running", "worker": "w-test"})
    control = redis.pubsub()
    await control.subscribe(KEYS.control)
    await control.get_message(timeout=1)  # the subscribe confirmation

    resp = await client.delete(f"/v1/jobs/{job_id}")
    assert resp.status == 202
    assert (await resp.json())["status"] == "running"
    message = await control.get_message(ignore_subscribe_messages=True, timeout=2)
    await control.aclose()
    assert message is not None and msgpack.unpackb(message["data"]) == {"type": "cancel", "id": job_id}
    assert await redis.get(KEYS.cancel(job_id)) == b"1"
    assert 0 < await redis.ttl(KEYS.cancel(job_id))
    assert (await redis.hget(KEYS.job(job_id), "status")) == b"running"  # the worker writes the final status


async def test_a_cancel_that_comes_as_its_worker_ends_the_job_is_told_it_ended(redis: aioredis.Redis) -> None:
    """The flag was set while the job ran, but its worker committed `succeeded` before any step saw it: the
    answer is the job's end (409 on DELETE), not a 202 with a finished record."""
    from gateway.cancel import AlreadyFinished, Canceller

    await redis.hset(KEYS.job("late"), mapping={"id": "late", "status": "running", "worker": "w-test"})
    canceller = Canceller(redis, KEYS, flag_ttl_s=60)
    flag_only = canceller.transition

    async def worker_ends_it_meanwhile(job_id: str) -> tuple[str, dict[str, Any]]:
        outcome = await flag_only(job_id)
        await redis.hset(KEYS.job(job_id), "status", "succeeded")  # as the worker's commit writes it
        return outcome

    canceller.transition = worker_ends_it_meanwhile  # type: ignore[method-assign]
    with pytest.raises(AlreadyFinished) as ended:
        await canceller.cancel("late")
    assert ended.value.status == "succeeded"
    await redis.hset(KEYS.job("late"), "status", "running")
    canceller.transition = flag_only  # type: ignore[method-assign]
    assert (await canceller.cancel("late")).view["status"] == "running"  # still running: the worker is asked


@pytest.fixture
async def configured_client(redis_url: str) -> AsyncIterator[TestClient]:
    webhooks = WebhookConfig(webhook_secret=generate_secret(), webhook_allow=["hooks.test"])
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, result_ttl_s=7200, reply_maxlen=1, webhooks=webhooks)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        yield client


async def test_cancelling_a_queued_job_delivers_it_in_the_same_script(
    configured_client: TestClient, redis: aioredis.Redis
) -> None:
    from gateway.cancel import Canceller

    job_id = await new_job(configured_client, reply_to="replies",
                           webhook={"url": "https://hooks.test/cb", "events": ["completed"]})
    for n in range(250):  # older results, in full stream nodes that a small MAXLEN ~ can trim
        await redis.xadd("replies", {"result": b"old %d" % n})
    events = redis.pubsub()
    await events.subscribe(KEYS.events(job_id))
    await events.get_message(timeout=1)  # the subscribe confirmation
    canceller = Canceller(redis, KEYS, flag_ttl_s=60, reply_maxlen=1)

    outcome, view = await canceller.transition(job_id)

    # Right after the script, with no more gateway code run: every effect is there already.
    assert outcome == "+cancelled" and view["status"] == "cancelled"
    assert (await redis.hget(KEYS.job(job_id), "status")) == b"cancelled"
    final = await events.get_message(ignore_subscribe_messages=True, timeout=2)
    assert final is not None and msgpack.unpackb(final["data"])["job"]["status"] == "cancelled"
    replies = await redis.xrange("replies")
    assert msgpack.unpackb(replies[-1][1][b"result"])["status"] == "cancelled"
    assert len(replies) < 251  # trimmed to the configured reply maxlen, not the default
    deliveries = await redis.xrange(KEYS.webhooks)
    assert len(deliveries) == 1 and deliveries[0][1][b"event"] == b"completed"
    assert json.loads(deliveries[0][1][b"payload"])["data"]["status"] == "cancelled"

    again, _ = await canceller.transition(job_id)
    assert again == "cancelled"
    assert await events.get_message(ignore_subscribe_messages=True, timeout=0.3) is None
    assert (await redis.xrange("replies"))[-1][0] == replies[-1][0]
    assert await redis.xlen(KEYS.webhooks) == 1
    await events.aclose()


async def test_cancel_flag_lives_as_long_as_the_result(configured_client: TestClient, redis: aioredis.Redis) -> None:
    queued, running = await new_job(configured_client), await new_job(configured_client)
    await redis.hset(KEYS.job(running), mapping={"status": "running", "worker": "w-test"})
    for job_id in (queued, running):
        assert (await configured_client.delete(f"/v1/jobs/{job_id}")).status == 202
        # A handed-back job may be resumed much later: its flag must outlive the wait, as the record does.
        assert await redis.ttl(KEYS.cancel(job_id)) > 7200 - 60


async def test_every_waiter_gets_its_subscription_only_once_redis_confirmed_it(redis: aioredis.Redis) -> None:
    from gateway.event_hub import EventHub, wait_for_terminal

    await redis.hset(KEYS.job("j"), mapping={"id": "j", "status": "queued"})
    hub = EventHub(redis)  # its reader is not started yet: no subscribe confirmation is seen
    entered: list[int] = []
    release = asyncio.Event()

    async def wait(n: int) -> None:
        async with hub.subscribe(KEYS.events("j")):
            entered.append(n)
            await release.wait()

    waiters = [asyncio.create_task(wait(1))]
    await asyncio.sleep(0.05)
    waiters.append(asyncio.create_task(wait(2)))  # joins the channel the first waiter is subscribing
    polls = [asyncio.create_task(wait_for_terminal(redis, hub, KEYS, "j", 5.0)) for _ in range(2)]
    await asyncio.sleep(0.3)
    assert entered == []  # neither waiter may re-read the record before the subscription is live
    await redis.hset(KEYS.job("j"), mapping={"status": "succeeded", "finished_at": repr(time.time())})
    await redis.publish(KEYS.events("j"), msgpack.packb({"type": "final", "id": "j", "job": {}}))
    hub.start()
    await wait_until(lambda: len(entered) == 2, "both waiters in, once Redis confirmed")
    assert sorted(entered) == [1, 2]
    release.set()
    await asyncio.gather(*waiters)
    records = await asyncio.wait_for(asyncio.gather(*polls), WAIT_S)
    assert [r[b"status"] for r in records] == [b"succeeded", b"succeeded"]
    await hub.stop()


async def test_long_poll_rereads_the_record_when_its_wait_ends(client: TestClient, redis: aioredis.Redis) -> None:
    job_id = await new_job(client)

    async def finish_without_event() -> None:
        while (await redis.pubsub_numsub(KEYS.events(job_id)))[0][1] == 0:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        await redis.hset(KEYS.job(job_id), mapping={"status": "failed", "finished_at": repr(time.time())})

    task = asyncio.create_task(finish_without_event())
    view = await (await client.get(f"/v1/jobs/{job_id}?wait=2")).json()
    await task
    assert view["status"] == "failed"  # the final event was never seen, the record still tells


async def test_a_pub_sub_connection_that_goes_silent_is_replaced(redis_url: str, redis: aioredis.Redis) -> None:
    """A network path that drops everything without closing: the hub's ping goes unanswered, it connects again,
    subscribes its channels again, and events published after that reach the waiter."""
    from gateway.event_hub import EventHub
    from tests.harness.redis_proxy import RedisProxy

    proxy = await RedisProxy(redis_url).start()
    client = aioredis.Redis.from_url(proxy.url)
    hub = EventHub(client, ping_interval_s=0.1, pong_timeout_s=0.5)
    hub.start()
    try:
        async with hub.subscribe(KEYS.events("j")) as sub:
            await redis.publish(KEYS.events("j"), msgpack.packb({"type": "token", "n": 1}))
            assert (await asyncio.wait_for(sub.queue.get(), WAIT_S))["n"] == 1
            proxy.go_silent()
            await redis.publish(KEYS.events("j"), msgpack.packb({"type": "token", "n": 2}))  # lost with the path
            await wait_until(lambda: hub.num_reconnects == 1, "the hub replacing its silent connection")

            async def delivered() -> dict[str, Any]:
                # Until the new connection's SUBSCRIBE is in, a publish reaches no one: publish until one arrives.
                while True:
                    await redis.publish(KEYS.events("j"), msgpack.packb({"type": "token", "n": 3}))
                    try:
                        return await asyncio.wait_for(sub.queue.get(), 0.2)
                    except asyncio.TimeoutError:
                        continue

            assert (await asyncio.wait_for(delivered(), WAIT_S))["n"] == 3
            assert proxy.num_connections == 2
    finally:
        await hub.stop()
        await client.aclose()
        await proxy.aclose()


async def test_a_long_poll_or_event_stream_whose_client_hung_up_stops_waiting(redis_url: str) -> None:
    """The server does not cancel a handler when its client leaves: a waiter looks whether its client is still
    there with every event and every second without one, and stops, rather than waiting out its ?wait= or its
    job (the heartbeat here is far longer than the test). Both a job that waits (no events) and one that runs
    (a token event every 50 ms, as a worker publishes them) are checked."""
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, sse_heartbeat_s=300, max_wait_s=300)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        base = str(client.make_url("")).rstrip("/")
        for is_running in (False, True):
            job_id = await new_job(client)
            publisher = asyncio.create_task(publish_tokens(redis_url, job_id)) if is_running else None
            try:
                await hang_up_on_a_long_poll_and_a_stream(client, base, job_id)
            finally:
                if publisher is not None:
                    publisher.cancel()
                    await asyncio.gather(publisher, return_exceptions=True)


async def publish_tokens(redis_url: str, job_id: str) -> None:
    """A token event on the job's channel every 50 ms, as a worker running it publishes them."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        for index in range(100_000):
            await redis.publish(KEYS.events(job_id), msgpack.packb(
                {"type": "token", "id": job_id, "index": index, "token_ids": [1], "text": "x", "text_index": index}))
            await asyncio.sleep(0.05)
    finally:
        await redis.aclose()


async def hang_up_on_a_long_poll_and_a_stream(client: TestClient, base: str, job_id: str) -> None:
    import aiohttp

    from tests.harness.telemetry_support import value

    async def open_waiters() -> float:
        return value(await (await client.get("/metrics")).text(), "carpool_gateway_open_waiters")

    async with aiohttp.ClientSession() as http:
        # A long-poll: no answer until the job ends; the client gives up before.
        poll = asyncio.create_task(http.get(f"{base}/v1/jobs/{job_id}?wait=300"))
        await wait_until(lambda: open_waiters_is(open_waiters, 1), "the long-poll waits")
        poll.cancel()
        with pytest.raises(asyncio.CancelledError):
            await poll
        await wait_until(lambda: open_waiters_is(open_waiters, 0), "the long-poll stops waiting", timeout_s=10)
        # An event stream: its headers came at once; the client closes it.
        stream = await http.get(f"{base}/v1/jobs/{job_id}/events")
        assert stream.status == 200
        await wait_until(lambda: open_waiters_is(open_waiters, 1), "the event stream waits")
        stream.close()
        await wait_until(lambda: open_waiters_is(open_waiters, 0), "the event stream stops waiting", timeout_s=10)


async def open_waiters_is(open_waiters: Any, count: int) -> bool:
    return await open_waiters() == count
