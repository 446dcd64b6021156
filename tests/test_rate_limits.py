"""Per-tenant limits on a real gateway, Redis and worker: requests and tokens per minute, queued jobs."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.api_keys import KeyStore
from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.tenants import TenantLimits
from worker_harness import KEYS, running_worker, wait_terminal

RESET = re.compile(r"^(\d+ms|\d+(\.\d+)?s|\d+m\d+s)$")


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[tuple[str, KeyStore]]:
    server = TestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, api_keys=True)),
                        host="127.0.0.1")
    await server.start_server()
    client = aioredis.Redis.from_url(redis_url)
    yield str(server.make_url("")).rstrip("/"), KeyStore(client, KEYS)
    await client.aclose()
    await server.close()


async def test_n_requests_per_minute_are_accepted_then_429_with_openai_headers(gateway) -> None:
    url, store = gateway
    key, _ = await store.create("metered", TenantLimits(requests_per_minute=5))
    headers = {"Authorization": f"Bearer {key}"}
    async with ClientSession() as http:
        for i in range(5):
            async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": f"p{i}"}) as resp:
                assert resp.status == 202
                assert resp.headers["x-ratelimit-limit-requests"] == "5"
                assert resp.headers["x-ratelimit-remaining-requests"] == str(4 - i)
                assert RESET.match(resp.headers["x-ratelimit-reset-requests"])
        for _ in range(3):
            async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "over"}) as resp:
                body = await resp.json()
                assert resp.status == 429 and body["error"]["type"] == "rate_limited"
                assert 1 <= int(resp.headers["Retry-After"]) <= 60
                assert resp.headers["x-ratelimit-limit-requests"] == "5"
                assert resp.headers["x-ratelimit-remaining-requests"] == "0"
                assert RESET.match(resp.headers["x-ratelimit-reset-requests"])
                assert "x-ratelimit-limit-tokens" not in resp.headers  # no tokens limit set
        # The OpenAI routes share the tenant's window, and refuse in OpenAI's shape.
        async with http.post(f"{url}/v1/chat/completions", headers=headers, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]}) as resp:
            body = await resp.json()
            assert resp.status == 429 and body["error"]["type"] == "rate_limit_error"
            assert body["error"]["code"] == "rate_limit_exceeded" and "Retry-After" in resp.headers
            assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        # Exactly five jobs were enqueued; another tenant is not held back by this one's window.
        assert await _queued_of(url, http, headers) == 5
        other, _ = await store.create("unmetered", TenantLimits())
        async with http.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {other}"},
                             json={"prompt": "free"}) as resp:
            assert resp.status == 202 and "x-ratelimit-limit-requests" not in resp.headers


async def _queued_of(url: str, http: ClientSession, headers: dict[str, str]) -> int:
    async with http.get(f"{url}/v1/usage", headers=headers) as resp:
        usage = await resp.json()
    assert usage["window"]["requests"] == 5
    return int(usage["queued"])


async def test_a_tenant_at_its_queued_maximum_gets_429_until_a_job_ends(gateway) -> None:
    url, store = gateway
    key, _ = await store.create("crowded", TenantLimits(max_queued=3))
    headers = {"Authorization": f"Bearer {key}"}
    async with ClientSession() as http:
        ids = []
        for i in range(3):
            async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": f"q{i}", "lane": "batch"
                                                                          if i else "standard"}) as resp:
                assert resp.status == 202
                ids.append((await resp.json())["id"])
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "fourth"}) as resp:
            assert resp.status == 429 and (await resp.json())["error"]["type"] == "quota_exceeded"
            assert "Retry-After" in resp.headers


async def test_tokens_per_minute_reserve_prompt_plus_max_tokens_and_settle_to_real_use(gateway, redis_url,
                                                                                         tiny_model) -> None:
    from worker.engine import Engine

    url, store = gateway
    key, _ = await store.create("tokens", TenantLimits(tokens_per_minute=100))
    headers = {"Authorization": f"Bearer {key}"}
    # 10 prompt tokens + max_tokens 40: 50 reserved each. Every token id stops generation, so each job really
    # uses 10 + 1.
    body = {"prompt_token_ids": list(range(1, 11)),
            "params": {"max_tokens": 40, "stop_token_ids": list(range(512))}}
    async with ClientSession() as http:
        ids = []
        for remaining in ("50", "0"):
            async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
                assert resp.status == 202
                assert resp.headers["x-ratelimit-limit-tokens"] == "100"
                assert resp.headers["x-ratelimit-remaining-tokens"] == remaining
                ids.append((await resp.json())["id"])
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 429 and "tokens per minute" in (await resp.json())["error"]["message"]
            assert resp.headers["x-ratelimit-remaining-tokens"] == "0" and "Retry-After" in resp.headers
        async with http.get(f"{url}/v1/usage", headers=headers) as resp:
            assert (await resp.json())["window"]["tokens"] == 100
        client = aioredis.Redis.from_url(redis_url)
        async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=4)):
            views = await wait_terminal(client, ids)
        used = sum(v["usage"]["prompt_tokens"] + v["usage"]["completion_tokens"] for v in views.values())
        assert all(v["status"] == "succeeded" and v["usage"]["completion_tokens"] == 1 for v in views.values())
        async with http.get(f"{url}/v1/usage", headers=headers) as resp:
            usage = await resp.json()
        assert usage["window"]["tokens"] == used == 22  # settled: the reservation became the real count
        assert usage["jobs"] == 2 and usage["jobs_by_status"] == {"succeeded": 2}
        assert usage["prompt_tokens"] == 20 and usage["completion_tokens"] == 2 and usage["queued"] == 0
        assert usage["limits"]["tokens_per_minute"] == 100
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202  # room again within the same window
        await client.aclose()
