"""Per-tenant limits on a real gateway, Redis and worker: requests and tokens per minute, queued jobs."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession, FormData

from gateway.api_keys import KeyStore
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.rate_limits import reset_text
from scheduler.protocol.tenants import TenantLimits
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.openai_support import MODEL_NAME
from tests.harness.telemetry_support import value
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, wait_until

RESET = re.compile(r"^(\d+ms|\d+(\.\d+)?s|\d+m\d+(\.\d+)?s)$")


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[tuple[str, KeyStore]]:
    async with _gateway(redis_url) as started:
        yield started


@pytest.fixture
async def gateway_64(redis_url: str) -> AsyncIterator[tuple[str, KeyStore]]:
    """A gateway that knows the model's context: 64 tokens (`--max-model-len`)."""
    async with _gateway(redis_url, max_model_len=64) as started:
        yield started


@asynccontextmanager
async def _gateway(redis_url: str, **config: Any) -> AsyncIterator[tuple[str, KeyStore]]:
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, api_keys=True, **config)),
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
        async with http.get(f"{url}/metrics") as resp:  # counted against the refused job's own lane
            exposition = await resp.text()
        assert value(exposition, "carpool_jobs_rejected_total", carpool_reject_reason="quota",
                     carpool_lane="standard") == 1
        # A cancel ends a queued job on the spot: its slot is free at once, with no worker running.
        async with http.delete(f"{url}/v1/jobs/{ids[1]}", headers=headers) as resp:
            assert resp.status == 202
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "fourth"}) as resp:
            assert resp.status == 202
        async with http.get(f"{url}/v1/usage", headers=headers) as resp:
            usage = await resp.json()
        assert usage["queued"] == 3 and usage["jobs_by_status"] == {"cancelled": 1}, usage


async def test_a_job_cancelled_while_queued_gives_back_its_tokens_and_leaves_its_lane(gateway, redis_url) -> None:
    """Its reservation is settled to the nothing it used, its lane entry is gone (the lane's depth and the
    tenant's queue count it no more, and no worker meets it after its record has expired)."""
    url, store = gateway
    key, _ = await store.create("tokens", TenantLimits(tokens_per_minute=100))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt_token_ids": list(range(1, 11)), "params": {"max_tokens": 40}}  # 50 reserved each
    client = aioredis.Redis.from_url(redis_url)
    async with ClientSession() as http:
        ids = []
        for _ in range(2):
            async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
                assert resp.status == 202
                ids.append((await resp.json())["id"])
        stream = KEYS.tenant_lane("standard", "tokens")
        assert await client.xlen(stream) == 2
        async with http.delete(f"{url}/v1/jobs/{ids[0]}", headers=headers) as resp:
            assert resp.status == 202 and (await resp.json())["status"] == "cancelled"
        assert await client.xlen(stream) == 1
        async with http.get(f"{url}/v1/usage", headers=headers) as resp:
            usage = await resp.json()
        assert usage["window"]["tokens"] == 50 and usage["queued"] == 1, usage
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202 and resp.headers["x-ratelimit-remaining-tokens"] == "0"
    await client.aclose()


async def test_tokens_per_minute_reserve_prompt_plus_max_tokens_and_settle_to_real_use(gateway, redis_url,
                                                                                         tiny_model) -> None:
    from worker.engine.engine import Engine

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


async def test_a_key_without_a_tokens_limit_still_counts_and_settles_its_tenants_tokens(gateway, redis_url,
                                                                                          tiny_model) -> None:
    """The window is the tenant's, not the key's: a key limiting only requests and queued jobs counts the tokens of
    what it enqueues (none of what it was refused), settled to the real use, so that another key of the tenant
    with a tokens limit finds the window as it really stands."""
    from worker.engine.engine import Engine

    url, store = gateway
    key, _ = await store.create("rpm-only", TenantLimits(requests_per_minute=100, max_queued=1))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt_token_ids": list(range(1, 11)),
            "params": {"max_tokens": 40, "stop_token_ids": list(range(512))}}  # 50 reserved, 11 used
    async with ClientSession() as http:
        statuses = []
        for _ in range(4):
            async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
                statuses.append(resp.status)
                if resp.status == 202:
                    job_id = (await resp.json())["id"]
        assert statuses == [202, 429, 429, 429]
        assert (await _usage(url, http, headers))["window"]["tokens"] == 50  # the refused three gave theirs back
        client = aioredis.Redis.from_url(redis_url)
        async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=4)):
            await wait_terminal(client, [job_id])
        await client.aclose()
        assert (await _usage(url, http, headers))["window"]["tokens"] == 11  # settled to the real use
        second, _ = await store.create("rpm-only", TenantLimits(tokens_per_minute=100))
        async with http.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {second}"}, json=body) as resp:
            assert resp.status == 202 and resp.headers["x-ratelimit-remaining-tokens"] == "39"


def test_reset_times_are_written_as_openai_writes_them_whatever_the_value() -> None:
    # Go's duration format: the same shape either side of a minute, never rounded into the next unit.
    assert [reset_text(ms) for ms in (0, 6, 999, 1000, 1500, 20_000, 59_960, 59_999, 60_000, 61_500, 63_000)] == [
        "0s", "6ms", "999ms", "1s", "1.5s", "20s", "59.96s", "59.999s", "1m0s", "1m1.5s", "1m3s"]
    assert all(RESET.match(reset_text(ms)) for ms in range(0, 120_000, 7))


async def _usage(url: str, http: ClientSession, headers: dict[str, str]) -> dict[str, Any]:
    async with http.get(f"{url}/v1/usage", headers=headers) as resp:
        return await resp.json()


async def test_refused_requests_count_no_request_against_rpm(gateway, redis_url, tiny_model) -> None:
    from worker.engine.engine import Engine

    url, store = gateway
    key, _ = await store.create("refused", TenantLimits(requests_per_minute=3, max_queued=1))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2, "stop_token_ids": list(range(512))}}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202
            first = (await resp.json())["id"]
        for _ in range(2):
            async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
                assert resp.status == 429 and (await resp.json())["error"]["type"] == "quota_exceeded"
                assert resp.headers["x-ratelimit-remaining-requests"] == "2"  # as it stands after the refusal
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": 7}) as resp:
            assert resp.status == 400
        assert (await _usage(url, http, headers))["window"]["requests"] == 1
        client = aioredis.Redis.from_url(redis_url)
        async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=4)):
            await wait_terminal(client, [first])
            await wait_until_queued(url, http, headers, 0)
        await client.aclose()
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "next"}) as resp:
            assert resp.status == 202, await resp.text()  # the quota's refusals left two of the three requests
            assert resp.headers["x-ratelimit-remaining-requests"] == "1"
        assert (await _usage(url, http, headers))["window"]["requests"] == 2


async def wait_until_queued(url: str, http: ClientSession, headers: dict[str, str], queued: int) -> None:
    """Until the tenant has `queued` jobs waiting or running (a worker deletes an entry just after its commit)."""
    async def settled() -> bool:
        return (await _usage(url, http, headers))["queued"] == queued

    await wait_until(settled, f"{queued} jobs queued")


async def test_an_idempotent_retry_gets_its_job_back_even_with_no_requests_left(gateway) -> None:
    url, store = gateway
    key, _ = await store.create("retrying", TenantLimits(requests_per_minute=2, tokens_per_minute=1000))
    headers = {"Authorization": f"Bearer {key}"}
    retry = {**headers, "Idempotency-Key": "order-1"}
    async with ClientSession() as http:
        answers = []
        for _ in range(3):
            async with http.post(f"{url}/v1/jobs", headers=retry, json={"prompt": "x", "params": {"max_tokens": 2}}) as resp:
                answers.append((resp.status, (await resp.json())["id"]))
        assert [status for status, _ in answers] == [202, 200, 200] and len({i for _, i in answers}) == 1
        window = (await _usage(url, http, headers))["window"]
        assert (window["requests"], window["tokens"]) == (1, 3)  # one job: prompt "x" ~1 token + max_tokens 2
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"id": "mine", "prompt": "y"}) as resp:
            assert resp.status == 202 and resp.headers["x-ratelimit-remaining-requests"] == "0"
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "z"}) as resp:
            assert resp.status == 429  # the window is used up...
        # ...yet a retry, by key or by id, is answered with its job, and counts nothing.
        async with http.post(f"{url}/v1/jobs", headers=retry, json={"prompt": "x", "params": {"max_tokens": 2}}) as resp:
            assert (resp.status, (await resp.json())["id"]) == (200, answers[0][1])
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"id": "mine", "prompt": "y"}) as resp:
            assert (resp.status, (await resp.json())["id"]) == (200, "mine")
        # Another tenant's id is refused as taken (not as over the limit), telling nothing of that job.
        neighbour, _ = await store.create("neighbour", TenantLimits())
        async with http.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {neighbour}"},
                             json={"id": "theirs", "prompt": "w"}) as resp:
            assert resp.status == 202
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"id": "theirs", "prompt": "w"}) as resp:
            assert resp.status == 409 and (await resp.json())["error"]["field"] == "id"
        assert (await _usage(url, http, headers))["window"]["requests"] == 2


async def test_a_job_without_max_tokens_reserves_the_rest_of_the_context_then_settles(
        gateway_64, redis_url, tiny_model) -> None:
    from worker.engine.config import DEFAULT_MODEL_NAME
    from worker.engine.engine import Engine

    url, store = gateway_64
    key, _ = await store.create("unbounded", TenantLimits(tokens_per_minute=100))
    headers = {"Authorization": f"Bearer {key}"}
    # 10 prompt tokens and no max_tokens: the job may run to the context's end, 64 tokens in all.
    body = {"prompt_token_ids": list(range(1, 11)), "params": {"max_tokens": None, "stop_token_ids": list(range(512))}}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202 and resp.headers["x-ratelimit-remaining-tokens"] == "36"
            job_id = (await resp.json())["id"]
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 429 and "requested 64" in (await resp.json())["error"]["message"]
        client = aioredis.Redis.from_url(redis_url)
        async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=4)):
            view = (await wait_terminal(client, [job_id]))[job_id]
        await client.aclose()
        assert view["status"] == "succeeded" and view["usage"]["completion_tokens"] == 1
        assert (await _usage(url, http, headers))["window"]["tokens"] == 11  # settled to the real use

        # A key whose whole minute is less than the context cannot take such a job: a 400 saying so, counting
        # nothing, on /v1/jobs and on the OpenAI routes (where chat without max_tokens is the default).
        small, _ = await store.create("small", TenantLimits(requests_per_minute=5, tokens_per_minute=50))
        small_headers = {"Authorization": f"Bearer {small}"}
        async with http.post(f"{url}/v1/jobs", headers=small_headers, json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["field"] == "params.max_tokens"
            assert "64 tokens" in error["message"] and "50 tokens per minute" in error["message"]
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=small, max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            # The model the worker above served: with no worker running, a request waits only for such a one.
            await oai.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.code == "rate_limit_exceeded" and "64 tokens" in refused.value.message
        await oai.close()
        assert (await _usage(url, http, small_headers))["window"]["requests"] == 0


async def test_without_a_known_context_an_unbounded_job_reserves_the_whole_minute(gateway) -> None:
    url, store = gateway  # no --max-model-len and no worker: the context is not known
    key, _ = await store.create("early", TenantLimits(tokens_per_minute=100))
    headers = {"Authorization": f"Bearer {key}"}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=headers,
                             json={"prompt": "hello", "params": {"max_tokens": None}}) as resp:
            assert resp.status == 202 and resp.headers["x-ratelimit-remaining-tokens"] == "0"
        # The largest tpm a key may have: its window's counts still fit, request after request.
        key, _ = await store.create("roomy", TenantLimits(tokens_per_minute=10**12))
        for status, remaining in ((202, "0"), (429, "0")):
            async with http.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                                 json={"prompt": "hello", "params": {"max_tokens": None}}) as resp:
                assert resp.status == status, await resp.text()
                assert resp.headers["x-ratelimit-remaining-tokens"] == remaining


async def test_n_over_max_queued_is_a_400_and_n_choices_need_room_for_all(gateway, redis) -> None:
    url, store = gateway
    key, _ = await store.create("choosy", TenantLimits(max_queued=3, requests_per_minute=10))
    headers = {"Authorization": f"Bearer {key}"}
    oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with pytest.raises(openai.BadRequestError) as refused:  # never retryable: n alone is over the quota
        await oai.chat.completions.create(**chat, n=4)
    assert refused.value.code == "queued_jobs_limit" and refused.value.param == "n"
    assert "n=4" in refused.value.message and "max_queued of 3" in refused.value.message
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "waiting"}) as resp:
            assert resp.status == 202
        with pytest.raises(openai.RateLimitError) as full:  # 1 queued + 3 choices > 3: no choice is enqueued
            await oai.chat.completions.create(**chat, n=3)
        assert full.value.code == "queued_jobs_limit"
        # The window as it stands after the refusal, as POST /v1/jobs answers a quota refusal.
        assert full.value.response.headers["x-ratelimit-remaining-requests"] == "9"
        usage = await _usage(url, http, headers)
    await oai.close()
    assert usage["queued"] == 1 and usage["window"]["requests"] == 1  # neither refusal counted
    assert [k async for k in redis.scan_iter(match=KEYS.job("chatcmpl-*"))] == []  # nothing enqueued, nothing to charge


async def test_a_job_the_worker_refuses_counts_as_failed_with_none_of_its_tokens(gateway, redis_url,
                                                                                   tiny_model) -> None:
    """A prompt past the model's context reaches the worker when the gateway has not yet learned the context:
    the worker refuses it, and the tenant's usage and tokens/min window count the job but none of its tokens
    (the record still says how long the prompt was)."""
    from worker.engine.engine import Engine

    url, store = gateway
    key, _ = await store.create("refused", TenantLimits(tokens_per_minute=1000, requests_per_minute=10))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt_token_ids": list(range(1, 41)), "params": {"max_tokens": 8}}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            assert resp.status == 202, await resp.text()
            job_id = (await resp.json())["id"]
        assert (await _usage(url, http, headers))["window"]["tokens"] == 48  # reserved: prompt + max_tokens
        client = aioredis.Redis.from_url(redis_url)
        async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=2, max_model_len=32),
                                  served_model_name=MODEL_NAME):
            view = (await wait_terminal(client, [job_id]))[job_id]
            # The same through the OpenAI route, a text prompt the gateway cannot count: admitted (the request
            # counts), refused by the worker, answered 400 with the window's headers as they stand.
            async with http.post(f"{url}/v1/completions", headers=headers,
                                 json={"model": MODEL_NAME, "prompt": "ab " * 30, "max_tokens": 2}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["code"] == "context_length_exceeded", error
                assert resp.headers["x-ratelimit-remaining-requests"] == "8"
        await client.aclose()
        assert view["status"] == "failed" and view["error"]["code"] == "context_length_exceeded", view
        assert view["usage"]["prompt_tokens"] == 40
        usage = await _usage(url, http, headers)
        assert usage["jobs_by_status"] == {"failed": 2}
        assert usage["prompt_tokens"] == usage["completion_tokens"] == usage["window"]["tokens"] == 0


async def test_batch_lines_are_not_held_to_max_queued_and_leave_the_tenants_room_alone(redis_url) -> None:
    """A tenant's Batch API lines are paced by the lane, not by its key's max_queued: a 10-line batch of a
    tenant allowed 3 queued jobs is enqueued whole, and the tenant still has its 3 jobs' room for online
    requests. Lines leave the count as they end (here: the batch is cancelled)."""
    async with _gateway(redis_url, batch_poll_interval_s=0.05) as (url, store):
        key, _ = await store.create("batchy", TenantLimits(max_queued=3))
        headers = {"Authorization": f"Bearer {key}"}
        lines = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {"model": "m", "prompt": "hi", "max_tokens": 2}}) for i in range(10))
        async with ClientSession() as http:
            form = FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", lines.encode(), filename="in.jsonl")
            async with http.post(f"{url}/v1/files", headers=headers, data=form) as resp:
                file_id = (await resp.json())["id"]
            async with http.post(f"{url}/v1/batches", headers=headers, json={
                    "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}) as resp:
                batch_id = (await resp.json())["id"]

            async def usage() -> dict[str, Any]:
                async with http.get(f"{url}/v1/usage", headers=headers) as resp:
                    return dict(await resp.json())

            async def all_lines_queued() -> bool:
                return (await usage())["batch_queued"] == 10

            await wait_until(all_lines_queued, "the batch's 10 lines enqueued")
            for _ in range(3):
                async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "online"}) as resp:
                    assert resp.status == 202, await resp.text()
            async with http.post(f"{url}/v1/jobs", headers=headers, json={"prompt": "online"}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 429 and error["type"] == "quota_exceeded" and "has 3 jobs" in error["message"]
            assert (await usage())["queued"] == 13
            async with http.post(f"{url}/v1/batches/{batch_id}/cancel", headers=headers) as resp:
                assert resp.status == 200

            async def lines_gone() -> bool:
                now = await usage()
                return now["batch_queued"] == 0 and now["queued"] == 3

            await wait_until(lines_gone, "the cancelled batch's lines out of the count")
