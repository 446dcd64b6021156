"""Webhooks end to end: gateway (with its in-process dispatcher) + a real worker + a real receiver."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.safety import is_public
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import Keys
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.webhook_receiver import Answer, Receiver
from tests.harness.worker_harness import running_worker, wait_until

SECRET = generate_secret()


async def start_gateway(redis_url: str, allow: list[str]) -> TestClient:
    webhooks = WebhookConfig(
        webhook_secret=SECRET, webhook_allow=allow, webhook_retry_schedule_s=[0.1, 0.2, 0.3],
        webhook_jitter=0.0, webhook_poll_s=0.02, webhook_timeout_s=30.0,
    )
    client = TestClient(GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, webhooks=webhooks))))
    await client.start_server()
    return client


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[TestClient]:
    """Receivers run on 127.0.0.1, which this gateway's allow-list admits."""
    client = await start_gateway(redis_url, ["127.0.0.1"])
    yield client
    await client.close()


@pytest.fixture
async def strict_gateway(redis_url: str) -> AsyncIterator[TestClient]:
    """No allow-list: only public addresses."""
    client = await start_gateway(redis_url, [])
    yield client
    await client.close()


async def test_receiver_gets_started_outputs_completed_in_order(redis_url, gateway, tiny_model) -> None:
    from worker.engine.engine import Engine

    receiver = await Receiver(SECRET, [Answer(503)], then=Answer(200)).start()
    try:
        engine = Engine(model=tiny_model(), max_num_seqs=4)
        async with running_worker(redis_url, engine, webhook_output_interval_s=0.0):
            body = {
                "prompt": "hello webhooks",
                "params": {"max_tokens": 24, "ignore_eos": True, "temperature": 0},
                "webhook": {"url": receiver.url},
            }
            resp = await gateway.post("/v1/jobs", json=body)
            assert resp.status == 202, await resp.text()
            job_id = (await resp.json())["id"]
            await wait_until(lambda: any(r.status == 200 and r.payload["type"] == "completed"
                                         for r in receiver.received), "the completed event accepted")
            job = await (await gateway.get(f"/v1/jobs/{job_id}")).json()
    finally:
        await receiver.stop()
    assert receiver.bad_signatures == 0
    accepted = [r.payload for r in receiver.received if r.status == 200]
    types = [p["type"] for p in accepted]
    assert types[0] == "started" and types[-1] == "completed" and types.count("completed") == 1
    assert set(types[1:-1]) == {"output"}, types
    assert all(p["data"]["id"] == job_id for p in accepted)
    final_text = job["output"]["text"]
    assert job["status"] == "succeeded" and final_text
    assert accepted[-1]["data"]["output"]["text"] == final_text
    assert accepted[-1]["data"]["status"] == "succeeded"
    partials = [p["data"]["output"]["text"] for p in accepted[1:-1]]
    assert all(final_text.startswith(t) for t in partials)
    # An `output` event carries the whole job view, as GET shows it, with the output so far.
    for p in accepted[1:-1]:
        data = p["data"]
        assert data.keys() == job.keys()
        assert data["status"] == "running" and data["output"]["finish_reason"] is None
        assert job["output"]["token_ids"][: len(data["output"]["token_ids"])] == data["output"]["token_ids"]
        for name in ("id", "lane", "priority", "worker", "attempts", "created_at", "started_at", "metadata"):
            assert data[name] == job[name], name
        assert data["finished_at"] is None and data["timings"]["queued_s"] == job["timings"]["queued_s"]
        assert data["timings"]["ttft_s"] is not None and data["timings"]["e2e_s"] is None
    # The first (503) attempt of `started` and its retry are both on the record, with one webhook-id.
    assert receiver.received[0].status == 503
    assert receiver.received[0].headers["webhook-id"] == receiver.received[1].headers["webhook-id"]
    client = aioredis.Redis.from_url(redis_url)

    async def attempts_recorded() -> bool:  # the last delivery is settled a moment after its answer
        attempts = job_view(await client.hgetall(Keys().job(job_id)))["webhooks"]
        return [a["outcome"] for a in attempts].count("delivered") >= len(accepted)

    try:
        await wait_until(attempts_recorded, "every accepted delivery on the job's record")
        attempts = job_view(await client.hgetall(Keys().job(job_id)))["webhooks"]
    finally:
        await client.aclose()
    assert attempts[0]["event"] == "started" and attempts[0]["status_code"] == 503
    assert [a["outcome"] for a in attempts].count("delivered") == len(accepted)


@pytest.mark.parametrize(
    "url",
    ["http://10.0.0.1/hook", "http://169.254.169.254/latest/meta-data/", "http://localhost:8080/hook",
     "http://localhost./hook", "http://[::1]/hook", "file:///etc/passwd"],
)
async def test_submission_refuses_non_public_webhooks(strict_gateway, redis_url, url: str) -> None:
    resp = await strict_gateway.post("/v1/jobs", json={"prompt": "hi", "webhook": {"url": url}})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["field"] == "webhook.url"
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert [await client.xlen(k) for k in Keys().lanes()] == [0, 0, 0], "a refused job is never queued"
    finally:
        await client.aclose()


def name_for_a_non_public_address() -> str:
    """A host name (not a ``localhost`` one, which is refused without DNS) that resolves locally to a non-public address.

    /etc/hosts normally maps the machine's own name (and in containers, loopback or the
    private container address), so the lookup never leaves the machine.
    """
    hosts = Path("/etc/hosts")
    candidates = [socket.gethostname()]
    if hosts.exists():
        for line in hosts.read_text().splitlines():
            parts = line.split("#", 1)[0].split()
            candidates += parts[1:]
    for name in candidates:
        if "localhost" in name.lower() or not name:
            continue
        try:
            infos = socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            continue
        if infos and not any(is_public(ipaddress.ip_address(i[4][0].split("%", 1)[0])) for i in infos):
            return name
    raise AssertionError("no host name on this machine resolves locally to a non-public address")


async def assert_refused_and_nothing_queued(gateway: TestClient, redis_url: str, url: str, reason: str) -> None:
    resp = await gateway.post("/v1/jobs", json={"prompt": "hi", "webhook": {"url": url}})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["field"] == "webhook.url" and reason in error["message"], error
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert [await client.xlen(k) for k in Keys().lanes()] == [0, 0, 0], "a refused job is never queued"
        assert await client.keys(Keys().job("*")) == [], "a refused job leaves no record"
    finally:
        await client.aclose()


async def test_submission_refuses_a_name_that_resolves_to_a_non_public_address(strict_gateway, redis_url) -> None:
    name = name_for_a_non_public_address()
    await assert_refused_and_nothing_queued(strict_gateway, redis_url, f"http://{name}:8080/hook", "non-public")


async def test_submission_refuses_a_name_that_does_not_resolve(strict_gateway, redis_url) -> None:
    await assert_refused_and_nothing_queued(
        strict_gateway, redis_url, "https://no-such-host.invalid/hook", "does not resolve"
    )


@pytest.mark.parametrize("host", ["2130706433", "127.1", "0x7f000001"])
async def test_submission_refuses_legacy_spellings_of_an_allowed_address(gateway, redis_url, host: str) -> None:
    # 127.0.0.1 is allow-listed, but the dispatcher's HTTP client does not connect to these spellings of it.
    await assert_refused_and_nothing_queued(gateway, redis_url, f"http://{host}:8290/hook", "dotted-decimal")
