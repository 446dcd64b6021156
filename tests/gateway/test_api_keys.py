"""API keys on a real gateway over a real Redis: 401s in each route's shape, revocation, tenants kept apart."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession, FormData

from gateway.api_keys import KeyStore
from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.tenants import TenantLimits
from tests.harness.child_env import child_pythonpath
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.telemetry_support import value
from tests.harness.worker_harness import KEYS

ROOT = Path(__file__).resolve().parents[2]


async def _gateway(redis_url: str) -> GatewayTestServer:
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, api_keys=True)),
                        host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def keyed(redis_url: str) -> AsyncIterator[tuple[str, str, str, aioredis.Redis]]:
    """(gateway URL, tenant a's key, tenant b's key, Redis client) with keys on."""
    server = await _gateway(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    store = KeyStore(client, KEYS)
    key_a, _ = await store.create("tenant-a", TenantLimits())
    key_b, _ = await store.create("tenant-b", TenantLimits())
    yield str(server.make_url("")).rstrip("/"), key_a, key_b, client
    await client.aclose()
    await server.close()


def _v1_routes(app_server_url: str, redis_url: str) -> list[tuple[str, str]]:
    app = init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, api_keys=True))
    routes = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and path.startswith("/v1") and route.method != "HEAD":
            routes.add((route.method, re.sub(r"\{[^}]+\}", "x1", path)))
    return sorted(routes)


async def test_every_v1_route_wants_a_key_and_answers_401_in_its_own_shape(keyed, redis_url: str) -> None:
    url, key_a, _, _ = keyed
    routes = _v1_routes(url, redis_url)
    assert len(routes) >= 15 and ("POST", "/v1/chat/completions") in routes and ("GET", "/v1/usage") in routes
    async with ClientSession() as http:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer cpk_wrong"}, {"Authorization": "Basic abc"},
                            {"Authorization": f"Bearer {key_a}x"}):
                async with http.request(method, url + path, headers=headers, json={}) as resp:
                    body = await resp.json()
                    assert resp.status == 401, (method, path, headers, body)
                    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                    if path.startswith(("/v1/jobs", "/v1/usage")):
                        assert body["error"]["type"] == "unauthorized", body
                    else:  # OpenAI's shape on the OpenAI routes
                        assert body["error"]["code"] == "invalid_api_key" and "param" in body["error"], body
        for path in ("/healthz", "/readyz", "/metrics"):
            async with http.get(url + path) as resp:
                assert resp.status == 200, path
    # A key that is no UTF-8 text (sent by hand: clients encode their headers) is as wrong as any other.
    host, port = url.removeprefix("http://").split(":")
    for method, path in (("GET", "/v1/usage"), ("GET", "/v1/models"), ("POST", "/v1/jobs")):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n".encode()
                     + b"Authorization: Bearer cpk_\xff\xfe\r\n\r\n{}")
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
        assert status_line.split()[1] == b"401", (method, path, status_line)
    # The OpenAI client sees its own authentication error.
    bad = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="cpk_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    good = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key_a, max_retries=0)
    assert (await good.models.list()).data == []
    await bad.close()
    await good.close()


async def test_a_revoked_key_stops_working_on_every_gateway_within_a_second(keyed, redis_url: str) -> None:
    url, _, _, client = keyed
    other = await _gateway(redis_url)
    urls = [url, str(other.make_url("")).rstrip("/")]
    store = KeyStore(client, KEYS)
    key, record = await store.create("short-lived", TenantLimits())
    headers = {"Authorization": f"Bearer {key}"}
    async with ClientSession() as http:
        for base in urls:
            async with http.get(f"{base}/v1/usage", headers=headers) as resp:
                assert resp.status == 200 and (await resp.json())["tenant"] == "short-lived"
        assert await store.revoke(record.id)
        revoked_at = time.monotonic()
        for base in urls:
            async with http.get(f"{base}/v1/usage", headers=headers) as resp:
                assert resp.status == 401
        assert time.monotonic() - revoked_at < 1.0
    await other.close()


async def test_revoking_a_tenants_latest_key_gives_it_back_the_weight_of_the_one_left(redis_url: str) -> None:
    """The tenant's latest key sets its fair-share weight; revoking that key hands the weight back to the latest
    key left (what `keys list` and /v1/usage show), and with no key left the last weight stays for its jobs."""
    client = aioredis.Redis.from_url(redis_url)
    store = KeyStore(client, KEYS)
    try:
        _, heavy = await store.create("weighted", TenantLimits(weight=6))
        _, light = await store.create("weighted", TenantLimits(weight=1))
        assert await client.hget(KEYS.tenant_weights, "weighted") == b"1"
        assert await store.revoke(light.id)
        assert await client.hget(KEYS.tenant_weights, "weighted") == b"6"
        assert await store.revoke(heavy.id)
        assert await client.hget(KEYS.tenant_weights, "weighted") == b"6"
    finally:
        await client.aclose()


async def test_a_tenant_sees_and_cancels_only_its_own_jobs_files_and_batches(keyed) -> None:
    url, key_a, key_b, client = keyed
    a, b = {"Authorization": f"Bearer {key_a}"}, {"Authorization": f"Bearer {key_b}"}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=a, json={"prompt": "hi", "tenant": "tenant-b"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["field"] == "tenant"  # no choosing
        async with http.post(f"{url}/v1/jobs", headers=a, json={"id": "a-job", "prompt": "hi"}) as resp:
            assert resp.status == 202
        # The tenant is in the message, from the key, and the job waits in tenant-a's own stream.
        (entry,) = await client.xrange(KEYS.tenant_lane("standard", "tenant-a"))
        assert b"tenant-a" in entry[1][b"job"]
        assert await client.smembers(KEYS.lane_tenants("standard")) == {b"tenant-a"}
        for method, path in (("GET", "/v1/jobs/a-job"), ("GET", "/v1/jobs/a-job/events"),
                             ("DELETE", "/v1/jobs/a-job"), ("GET", "/v1/jobs/a-job?wait=1")):
            async with http.request(method, url + path, headers=b) as resp:
                assert resp.status == 404, (method, path)
        async with http.get(f"{url}/v1/jobs/a-job", headers=a) as resp:
            assert resp.status == 200
            view = await resp.json()
            assert view["status"] == "queued" and view["tenant"] == "tenant-a"
        form = FormData()
        form.add_field("purpose", "batch")
        line = {"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}
        form.add_field("file", io.BytesIO(json.dumps(line).encode()), filename="in.jsonl")
        async with http.post(f"{url}/v1/files", headers=a, data=form) as resp:
            file_id = (await resp.json())["id"]
        async with http.post(f"{url}/v1/batches", headers=b, json={
                "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}) as resp:
            assert resp.status == 400  # b cannot start a batch on a's file
        async with http.post(f"{url}/v1/batches", headers=a, json={
                "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}) as resp:
            batch_id = (await resp.json())["id"]
        for method, path in (("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                             ("DELETE", f"/v1/files/{file_id}"), ("GET", f"/v1/batches/{batch_id}"),
                             ("POST", f"/v1/batches/{batch_id}/cancel")):
            async with http.request(method, url + path, headers=b) as resp:
                assert resp.status == 404, (method, path)
        for path, key in (("/v1/files", "data"), ("/v1/batches", "data")):
            async with http.get(url + path, headers=b) as resp:
                assert (await resp.json())[key] == []
            async with http.get(url + path, headers=a) as resp:
                assert len((await resp.json())[key]) == 1
        for path, own_id in (("/v1/files", file_id), ("/v1/batches", batch_id)):
            # Paging after another tenant's id is refused as after an unknown one: nothing tells it exists.
            async with http.get(f"{url}{path}?after={own_id}", headers=b) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "after"
            async with http.get(f"{url}{path}?after={own_id}", headers=a) as resp:
                assert resp.status == 200 and (await resp.json())["data"] == []
        async with http.delete(f"{url}/v1/jobs/a-job", headers=a) as resp:
            assert resp.status == 202 and (await resp.json())["status"] == "cancelled"


async def test_idempotency_keys_and_job_ids_are_each_tenants_own(keyed) -> None:
    url, key_a, key_b, client = keyed
    a, b = {"Authorization": f"Bearer {key_a}"}, {"Authorization": f"Bearer {key_b}"}
    job = {"prompt": "x", "params": {"max_tokens": 2}}
    async with ClientSession() as http:
        ids = {}
        for name, headers in (("a", a), ("b", b), ("b again", b)):
            async with http.post(f"{url}/v1/jobs", headers={**headers, "Idempotency-Key": "shared-k"}, json=job) as resp:
                ids[name] = (resp.status, (await resp.json())["id"])
        # The same key names a job of each tenant's own; a retry by b gets b's.
        assert ids["a"][0] == ids["b"][0] == 202 and ids["a"][1] != ids["b"][1] and ids["b again"] == (200, ids["b"][1])
        assert await client.get(KEYS.idempotency("tenant-a", "shared-k")) == ids["a"][1].encode()
        assert await client.get(KEYS.idempotency("tenant-b", "shared-k")) == ids["b"][1].encode()
        async with http.get(f"{url}/v1/jobs/{ids['b'][1]}", headers=b) as resp:
            assert resp.status == 200 and (await resp.json())["tenant"] == "tenant-b"

        # A job id another tenant holds is refused, telling nothing of that job, with or without a key.
        async with http.post(f"{url}/v1/jobs", headers=a, json={**job, "id": "a-job-1"}) as resp:
            assert resp.status == 202
        for headers in (b, {**b, "Idempotency-Key": "k2"}):
            async with http.post(f"{url}/v1/jobs", headers=headers, json={**job, "id": "a-job-1"}) as resp:
                body = await resp.json()
                assert resp.status == 409 and body["error"]["type"] == "conflict" and body["error"]["field"] == "id"
                assert set(body) == {"error"} and "queued" not in json.dumps(body)
        assert await client.get(KEYS.idempotency("tenant-b", "k2")) is None
        async with http.get(f"{url}/metrics") as resp:  # each refusal counted as a conflict, in the job's lane
            exposition = await resp.text()
        assert value(exposition, "carpool_jobs_rejected_total", carpool_reject_reason="conflict",
                     carpool_lane="standard") == 2
        async with http.get(f"{url}/v1/jobs/a-job-1", headers=a) as resp:
            view = await resp.json()
            assert view["tenant"] == "tenant-a" and view["status"] == "queued"
        # b's jobs are in b's stream only: the two from its key, none from the refused ids.
        assert await client.xlen(KEYS.tenant_lane("standard", "tenant-b")) == 1
        assert await client.xlen(KEYS.tenant_lane("standard", "tenant-a")) == 2

        # A key left naming a job that is now another tenant's (its own expired, the id reused) names nothing:
        # the next request with it makes a job of its own, and hears nothing of the other's.
        await client.set(KEYS.idempotency("tenant-b", "stale"), "a-job-1")
        async with http.post(f"{url}/v1/jobs", headers={**b, "Idempotency-Key": "stale"}, json=job) as resp:
            reply = await resp.json()
            assert resp.status == 202 and reply["id"] != "a-job-1", reply
        assert await client.get(KEYS.idempotency("tenant-b", "stale")) == reply["id"].encode()


async def test_a_tenant_replies_only_to_streams_under_its_own_name(keyed) -> None:
    """A tenant's `reply_to` starts with its name and a colon: no tenant can add results to, or trim, another
    tenant's reply stream, or write into any other key of the deployment's Redis."""
    url, key_a, key_b, client = keyed
    a, b = {"Authorization": f"Bearer {key_a}"}, {"Authorization": f"Bearer {key_b}"}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=a, json={"prompt": "x", "reply_to": "tenant-a:inbox"}) as resp:
            assert resp.status == 202
        for headers, reply_to in ((b, "tenant-a:inbox"), (a, "tenant-a-inbox"), (a, "inbox"), (b, "other-app:queue")):
            async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "x", "reply_to": reply_to}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["field"] == "reply_to", error
                assert "must start with" in error["message"], error
    assert await client.xlen(KEYS.tenant_lane("standard", "tenant-b")) == 0


async def test_the_enqueue_script_itself_refuses_another_tenants_job_id(keyed) -> None:
    """Two tenants racing for one id: the script that writes the record decides, and tells the loser nothing."""
    from gateway.admission import Admission, JobIdTaken
    from gateway.api_keys import Caller

    url, key_a, _, client = keyed
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {key_a}"},
                             json={"id": "raced", "prompt": "x"}) as resp:
            assert resp.status == 202
    admission = Admission(client, KEYS, GatewayConfig(), None)
    caller_b = Caller("tenant-b", TenantLimits(), is_keyed=True)
    spec = await admission.validate({"id": "raced", "prompt": "x"}, caller_b)
    with pytest.raises(JobIdTaken):
        await admission.enqueue(spec, "k", caller=caller_b)
    assert await client.get(KEYS.idempotency("tenant-b", "k")) is None
    assert await client.xlen(KEYS.tenant_lane("standard", "tenant-b")) == 0


def _carpool(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT), "CARPOOL_REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "keys", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


async def test_keys_cli_creates_lists_and_revokes_and_redis_keeps_only_a_hash(redis_url: str) -> None:
    made = _carpool(redis_url, "create", "--tenant", "acme", "--limits", "rpm=60,tpm=4000,max_queued=10,weight=2")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("cpk_") and "shown only now" in made.stderr
    listed = _carpool(redis_url, "list", "--json")
    (entry,) = json.loads(listed.stdout)
    assert entry["tenant"] == "acme" and entry["limits"] == {
        "max_queued": 10, "requests_per_minute": 60, "tokens_per_minute": 4000, "weight": 2}
    assert key not in listed.stdout
    client = aioredis.Redis.from_url(redis_url)
    for name in await client.keys("*"):
        kind = (await client.type(name)).decode()
        values = (await client.hgetall(name)).items() if kind == "hash" else [(name, await client.get(name))]
        assert not any(key.encode() in (k or b"") + (v or b"") for k, v in values), name
    assert await client.hget(KEYS.tenant_weights, "acme") == b"2"
    assert _carpool(redis_url, "create", "--tenant", "default").returncode == 2  # reserved
    assert _carpool(redis_url, "create", "--tenant", "x", "--limits", "rpm=fast").returncode == 2
    # The key prefix: the tenant's reply streams (carpool:...) would be carpool's own keys.
    as_prefix = _carpool(redis_url, "create", "--tenant", "carpool")
    assert as_prefix.returncode == 2 and "key prefix" in as_prefix.stderr, as_prefix.stderr
    # A number past every limit, with more digits than Python turns into an int unasked.
    huge = _carpool(redis_url, "create", "--tenant", "x", "--limits", "rpm=" + "9" * 5000)
    assert huge.returncode == 2 and "must be at most 1000000000000" in huge.stderr, huge.stderr
    assert _carpool(redis_url, "revoke", entry["id"]).returncode == 0
    assert _carpool(redis_url, "revoke", entry["id"]).returncode == 1
    assert json.loads(_carpool(redis_url, "list", "--json").stdout) == []
    assert await KeyStore(client, KEYS).lookup(key) is None
    await client.aclose()


async def test_readyz_counts_each_lanes_waiting_and_running_jobs_over_the_tenants_streams(keyed) -> None:
    """With keys on, jobs wait in their tenants' streams: /readyz's lane counts (what an autoscaler reads)
    take them in, `waiting` until a worker receives one and `running` from then on."""
    url, key_a, key_b, client = keyed
    async with ClientSession() as http:
        for key in (key_a, key_a, key_b):
            async with http.post(f"{url}/v1/jobs", json={"prompt": "x"},
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                assert resp.status == 202, await resp.text()
        async with http.get(f"{url}/readyz") as resp:
            standard = (await resp.json())["lanes"]["standard"]
        assert standard == {"depth": 3, "max_depth": standard["max_depth"], "waiting": 3, "running": 0}
        # A live worker receives tenant a's first job (as workers read: XREADGROUP on the tenant's stream).
        await client.hset(KEYS.workers, "w1", msgpack.packb({"time": time.time(), "running": 1, "capacity": 8}))
        received = await client.xreadgroup("carpool-workers", "w1", {KEYS.tenant_lane("standard", "tenant-a"): ">"},
                                           count=1)
        assert len(received[0][1]) == 1
        async with http.get(f"{url}/readyz") as resp:
            standard = (await resp.json())["lanes"]["standard"]
        assert (standard["depth"], standard["waiting"], standard["running"]) == (3, 2, 1)


async def test_an_invalid_job_a_producer_xadded_for_a_tenant_fails_as_that_tenants(keyed, redis_url, tiny_model) -> None:
    """Its failed record is the tenant's: its key reads it (another tenant's gets a 404), as with a valid job."""
    import msgpack

    from tests.harness.worker_harness import running_worker, wait_terminal
    from worker.engine.engine import Engine

    url, key_a, key_b, client = keyed
    bad = {"v": 1, "id": "bad-for-a", "tenant": "tenant-a", "prompt": "x", "params": {"temperature": -1}}
    await client.xadd(KEYS.lane("standard"), {"job": msgpack.packb(bad)})
    async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=2)):
        views = await wait_terminal(client, ["bad-for-a"])
    assert views["bad-for-a"]["status"] == "failed" and views["bad-for-a"]["tenant"] == "tenant-a"
    async with ClientSession() as http:
        async with http.get(f"{url}/v1/jobs/bad-for-a", headers={"Authorization": f"Bearer {key_a}"}) as resp:
            assert resp.status == 200 and (await resp.json())["error"]["field"] == "params.temperature"
        async with http.get(f"{url}/v1/jobs/bad-for-a", headers={"Authorization": f"Bearer {key_b}"}) as resp:
            assert resp.status == 404
