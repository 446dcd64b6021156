"""The gateway's HTTP API against a real redis-server, through a real aiohttp server and client."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis
import yarl
from aiohttp.test_utils import TestClient

from gateway import model_limits
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import Keys
from scheduler.protocol.tenants import DEFAULT_TENANT
from tests.harness.gateway_server import GatewayTestServer

KEYS = Keys()
SECRET = generate_secret()

MakeClient = Callable[..., Any]


@pytest.fixture
async def make_client(redis_url: str) -> AsyncIterator[MakeClient]:
    clients: list[TestClient] = []

    async def make(**overrides: Any) -> TestClient:
        webhooks = WebhookConfig(webhook_secret=SECRET)
        config = GatewayConfig(redis_url=redis_url, no_webhooks=True, webhooks=webhooks, **overrides)
        client = TestClient(GatewayTestServer(init_app(config)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: MakeClient) -> TestClient:
    return await make_client()


async def submit(client: TestClient, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/v1/jobs", json=body, headers=headers)
    return resp.status, await resp.json()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "prompt"),
        ({"prompt": "hi", "lane": "fast"}, "lane"),
        ({"prompt": "hi", "params": {"temperature": -1}}, "params.temperature"),
        ({"prompt": "hi", "params": {"max_tokens": 0}}, "params.max_tokens"),
        ({"prompt": "hi", "colour": "red"}, "colour"),
        ({"prompt_token_ids": [1, "x"]}, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(64))}, "prompt_token_ids"),
        ({"prompt": "hi", "params": {"max_tokens": 64}}, "params.max_tokens"),
        ({"prompt": "hi", "params": {"max_tokens": None, "min_tokens": 64}}, "params.min_tokens"),
        ({"prompt": "hi", "deadline": 1.0}, "deadline"),
        ({"prompt": "hi", "webhook": {"url": "ftp://example.com/hook"}}, "webhook.url"),
        ({"prompt": "hi", "webhook": {"url": "http://127.0.0.1:9/hook"}}, "webhook.url"),
        ({"prompt": "hi", "messages": [{"role": "robot", "content": "x"}], "prompt_token_ids": None}, "prompt"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "nmae": "bob"}]}, "messages[0].nmae"),
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
        ({"prompt": "hi", "webhook": {"url": "https://93.184.216.34:0/hook"}}, "webhook.url"),
    ],
)
async def test_bad_bodies_get_400_naming_the_field(
    make_client: MakeClient, redis: aioredis.Redis, body: dict[str, Any], field: str
) -> None:
    client = await make_client(max_model_len=64)
    status, reply = await submit(client, body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request"
    assert reply["error"]["field"] == field
    assert reply["error"]["message"]
    assert sum([await redis.xlen(stream) for stream in KEYS.lanes()]) == 0


async def test_a_chat_messages_null_name_is_no_name(make_client: MakeClient) -> None:
    client = await make_client()
    status, reply = await submit(client, {"messages": [{"role": "user", "content": "x", "name": None}]})
    assert status == 202, reply


async def test_webhooks_are_refused_without_a_signing_secret(redis_url: str) -> None:
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        status, reply = await submit(client, {"prompt": "hi", "webhook": {"url": "https://example.com/hook"}})
        assert status == 400
        assert reply["error"]["field"] == "webhook.url" and "secret" in reply["error"]["message"]
        assert (await submit(client, {"prompt": "hi"}))[0] == 202


async def test_the_location_of_a_job_whose_id_holds_url_characters_leads_to_it(client: TestClient) -> None:
    for job_id in ("x/y?z#w", "jöb%2F", "{tag}", "a{b}c"):
        resp = await client.post("/v1/jobs", json={"id": job_id, "prompt": "hello"})
        assert resp.status == 202
        location = resp.headers["Location"]
        assert location.isascii() and location.startswith("/v1/jobs/") and "?" not in location
        followed = await client.get(yarl.URL(location, encoded=True))
        assert followed.status == 200 and (await followed.json())["id"] == job_id
        events = await client.get(yarl.URL(location + "/events", encoded=True), headers={"Accept": "text/event-stream"})
        assert events.status == 200
        events.close()
        cancelled = await client.delete(yarl.URL(location, encoded=True))
        assert cancelled.status == 202 and (await cancelled.json())["status"] == "cancelled", job_id


async def test_body_that_is_not_json_names_the_body(client: TestClient) -> None:
    resp = await client.post("/v1/jobs", data=b"{nope", headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"]["field"] == "body"


async def test_submission_writes_record_and_lane_entry(client: TestClient, redis: aioredis.Redis) -> None:
    before = time.time()
    resp = await client.post("/v1/jobs", json={"prompt": "hello", "lane": "interactive", "priority": 3,
                                               "params": {"max_tokens": 5}, "metadata": {"k": "v"}})
    assert resp.status == 202
    reply = await resp.json()
    assert reply["status"] == "queued" and reply["id"].startswith("job_")
    assert resp.headers["Location"] == f"/v1/jobs/{reply['id']}"

    record = await redis.hgetall(KEYS.job(reply["id"]))
    assert record[b"status"] == b"queued"
    assert record[b"lane"] == b"interactive"
    assert record[b"priority"] == b"3"
    assert before <= float(record[b"created_at"]) <= time.time()
    # While it waits: the long backstop, not the result's time to live.
    assert GatewayConfig().result_ttl_s < await redis.ttl(KEYS.job(reply["id"])) <= GatewayConfig().queued_ttl_s

    entries = await redis.xrange(KEYS.lane("interactive"))
    assert len(entries) == 1
    entry_id, fields = entries[0]
    spec = JobSpec.unpack(fields[b"job"])
    assert (spec.id, spec.prompt, spec.params.max_tokens, spec.metadata) == (reply["id"], "hello", 5, {"k": "v"})
    assert record[b"stream_entry"].decode() == f"{KEYS.lane('interactive')} {entry_id.decode()}"

    view = await (await client.get(f"/v1/jobs/{reply['id']}")).json()
    assert view["status"] == "queued" and view["lane"] == "interactive" and view["metadata"] == {"k": "v"}
    assert view["output"] is None and view["timings"]["e2e_s"] is None


async def test_reused_id_is_the_same_job(client: TestClient, redis: aioredis.Redis) -> None:
    first = await submit(client, {"id": "mine-1", "prompt": "a"})
    second = await submit(client, {"id": "mine-1", "prompt": "something else"})
    assert first == (202, {"id": "mine-1", "status": "queued"})
    assert second == (200, {"id": "mine-1", "status": "queued"})
    assert await redis.xlen(KEYS.lane("standard")) == 1


async def test_idempotency_key_maps_to_the_first_job(client: TestClient, redis: aioredis.Redis) -> None:
    status1, first = await submit(client, {"prompt": "a"}, **{"Idempotency-Key": "order-7"})
    status2, second = await submit(client, {"prompt": "a"}, **{"Idempotency-Key": "order-7"})
    status3, other = await submit(client, {"prompt": "a"}, **{"Idempotency-Key": "order-8"})
    assert (status1, status2, status3) == (202, 200, 202)
    assert second["id"] == first["id"] != other["id"]
    assert await redis.get(KEYS.idempotency(DEFAULT_TENANT, "order-7")) == first["id"].encode()
    assert await redis.xlen(KEYS.lane("standard")) == 2


async def test_full_lane_gets_429_with_retry_after(make_client: MakeClient, redis: aioredis.Redis) -> None:
    client = await make_client(max_lane_depth={"batch": 2}, retry_after_s=7)
    assert [(await submit(client, {"prompt": "x", "lane": "batch"}))[0] for _ in range(2)] == [202, 202]
    resp = await client.post("/v1/jobs", json={"prompt": "x", "lane": "batch"}, headers={"Idempotency-Key": "k1"})
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "7"
    assert (await resp.json())["error"]["type"] == "lane_full"
    assert await redis.get(KEYS.idempotency(DEFAULT_TENANT, "k1")) is None  # a refused request does not hold its key
    assert (await submit(client, {"prompt": "x", "lane": "interactive"}))[0] == 202
    assert await redis.xlen(KEYS.lane("batch")) == 2


async def test_unknown_job_is_404(client: TestClient) -> None:
    for method, path in [("GET", "/v1/jobs/nope"), ("GET", "/v1/jobs/nope/events"), ("DELETE", "/v1/jobs/nope")]:
        resp = await client.request(method, path)
        assert resp.status == 404, path
        assert (await resp.json())["error"]["type"] == "not_found"


async def test_bad_wait_is_400(client: TestClient) -> None:
    _, job = await submit(client, {"prompt": "x"})
    for bad in ("soon", "-1", "nan", "1_0", "0x10", ""):
        resp = await client.get(f"/v1/jobs/{job['id']}", params={"wait": bad})
        assert resp.status == 400 and (await resp.json())["error"]["field"] == "wait", bad
    # Any length of wait is capped at --max-wait-s, however it is written (a queued job's record comes back
    # after the cap: here the client's own timeout would end it first, so only the short forms are waited out).
    for fine in ("0", "0.05", ".05", "5e-2"):
        resp = await client.get(f"/v1/jobs/{job['id']}", params={"wait": fine})
        assert resp.status == 200, fine


async def test_health_readiness_and_metrics(client: TestClient, redis: aioredis.Redis) -> None:
    await redis.hset(KEYS.workers, "w1", msgpack.packb({"time": time.time(), "running": 0, "capacity": 8}))
    await submit(client, {"prompt": "x", "lane": "batch"})
    assert (await (await client.get("/healthz")).json()) == {"status": "ok"}
    ready = await (await client.get("/readyz")).json()
    assert ready["status"] == "ready"
    assert ready["lanes"]["batch"]["depth"] == 1 and ready["lanes"]["interactive"]["depth"] == 0
    assert ready["workers"]["w1"]["capacity"] == 8
    text = await (await client.get("/metrics")).text()
    assert re.search(r'^carpool_jobs_submitted_total\{.*carpool_lane="batch".*\} 1\.0$', text, re.M), text


async def test_readyz_is_503_without_redis() -> None:
    from gateway.cli.embedded_redis import free_port

    config = GatewayConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0", no_webhooks=True)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        resp = await client.get("/readyz")
        assert resp.status == 503
        assert (await resp.json())["status"] == "unavailable"


async def test_prompt_token_ids_past_the_workers_vocabulary_are_refused(make_client: MakeClient,
                                                                       redis: aioredis.Redis,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers' heartbeats carry their vocabulary's size: an id past it is a 400 naming it, not a job that fails on
    a worker; before any worker says, the worker judges."""
    monkeypatch.setattr(model_limits, "REFRESH_S", 0.0)  # the heartbeats read at every admission
    client = await make_client()
    status, _ = await submit(client, {"prompt_token_ids": [5, 300]})
    assert status == 202
    await redis.hset(KEYS.workers, "w1", msgpack.packb({"time": time.time(), "running": 0, "capacity": 8,
                                                        "max_model_len": 64, "vocab_size": 262}))
    status, reply = await submit(client, {"prompt_token_ids": [5, 261, 262]})
    assert status == 400, reply
    assert reply["error"]["field"] == "prompt_token_ids"
    assert "token id 262 (at 2) is outside the model's vocabulary (0..261)" in reply["error"]["message"]
    status, _ = await submit(client, {"prompt_token_ids": [5, 261]})
    assert status == 202
    status, reply = await submit(client, {"prompt": "hi", "params": {"stop_token_ids": [2, 300]}})
    assert status == 400, reply
    assert reply["error"]["field"] == "params.stop_token_ids"
    assert "token id 300 (at 1) is outside the model's vocabulary (0..261): it is never generated" in \
        reply["error"]["message"]


async def test_a_record_and_its_idempotency_key_get_the_results_time_to_live_when_the_job_ends(
        client: TestClient, redis: aioredis.Redis) -> None:
    """A job queued behind a backlog longer than --result-ttl-s stays readable, cancellable and found by its key
    (up to --queued-ttl-s, a week); its result's time to live starts when it ends, for the record and its key."""
    config = GatewayConfig()
    resp = await client.post("/v1/jobs", json={"prompt": "later"}, headers={"Idempotency-Key": "k-1"})
    job_id = (await resp.json())["id"]
    idem = KEYS.idempotency("default", "k-1")
    for key in (KEYS.job(job_id), idem):
        assert config.result_ttl_s < await redis.ttl(key) <= config.queued_ttl_s
    assert (await client.delete(f"/v1/jobs/{job_id}")).status == 202
    for key in (KEYS.job(job_id), idem):
        assert 0 < await redis.ttl(key) <= config.result_ttl_s
    again = await client.post("/v1/jobs", json={"prompt": "later"}, headers={"Idempotency-Key": "k-1"})
    assert again.status == 200 and (await again.json())["id"] == job_id


async def test_every_idempotency_key_naming_a_job_lives_as_long_as_its_record(
        client: TestClient, redis: aioredis.Redis) -> None:
    """A second key sent with the same id names the job too: while it waits, until its end gives the record the
    result's time to live (then the key too); sent after the end, the record's time left."""
    config = GatewayConfig()
    body = {"id": "named-twice", "prompt": "later"}
    assert (await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "first"})).status == 202
    for key in ("second", "second"):  # a retry of the second adds nothing
        again = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
        assert again.status == 200 and (await again.json())["id"] == "named-twice"
    assert await redis.hget(KEYS.job("named-twice"), "idempotency_keys") == KEYS.idempotency("default", "second").encode()
    assert (await client.delete("/v1/jobs/named-twice")).status == 202
    keys = [KEYS.idempotency("default", name) for name in ("first", "second")]
    for key in (KEYS.job("named-twice"), *keys):
        assert 0 < await redis.ttl(key) <= config.result_ttl_s, key
    late = KEYS.idempotency("default", "after-the-end")
    assert (await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "after-the-end"})).status == 200
    assert 0 < await redis.ttl(late) <= await redis.ttl(KEYS.job("named-twice"))
    assert await redis.get(late) == b"named-twice"


async def test_a_max_model_len_above_the_workers_context_does_not_admit_what_they_cannot_run(
        make_client: MakeClient, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max-model-len` caps the context the workers' heartbeats report; set above it, the workers' context
    still refuses a job up front rather than a worker failing it later. Before any worker says, it is the limit."""
    monkeypatch.setattr(model_limits, "REFRESH_S", 0.0)  # the heartbeats read at every admission
    client = await make_client(max_model_len=100)
    status, reply = await submit(client, {"prompt_token_ids": [5] * 10, "params": {"max_tokens": 91}})
    assert status == 400 and reply["error"]["field"] == "params.max_tokens", reply
    assert (await submit(client, {"prompt_token_ids": [5] * 10, "params": {"max_tokens": 80}}))[0] == 202
    await redis.hset(KEYS.workers, "w1", msgpack.packb({"time": time.time(), "running": 0, "capacity": 8,
                                                        "max_model_len": 64, "vocab_size": 262}))
    status, reply = await submit(client, {"prompt_token_ids": [5] * 10, "params": {"max_tokens": 80}})
    assert status == 400 and reply["error"]["field"] == "params.max_tokens", reply
    assert "64" in reply["error"]["message"]
    assert (await submit(client, {"prompt_token_ids": [5] * 10, "params": {"max_tokens": 50}}))[0] == 202
