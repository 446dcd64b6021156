"""A job's life through a real gateway, Redis and worker: what a cancel keeps, what a hand-back counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.params import SamplingParams
from worker_harness import KEYS, running_worker, wait_terminal


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[str]:
    server = TestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)), host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
def make_engine(tiny_model: Callable[..., str]) -> Callable[..., Any]:
    from worker.engine import Engine

    return lambda **kw: Engine(model=tiny_model(), max_num_seqs=kw.pop("max_num_seqs", 4), **kw)


async def _wait_checkpoint(client: aioredis.Redis, job_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.hget(KEYS.job(job_id), "checkpoint"):
        assert time.monotonic() < deadline, f"{job_id} never checkpointed"
        await asyncio.sleep(0.05)


LONG = {"prompt": "tell me everything", "params": {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}}


async def test_cancelling_a_running_job_keeps_its_partial_output(
    gateway: str, redis_url: str, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine()
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(redis_url, engine, checkpoint_tokens=4), ClientSession() as http:
            async with http.post(f"{gateway}/v1/jobs", json={"id": "cancel-me", **LONG}) as resp:
                assert resp.status == 202
            await _wait_checkpoint(client, "cancel-me")
            async with http.delete(f"{gateway}/v1/jobs/cancel-me") as resp:
                assert resp.status in (200, 202), await resp.text()
            views = await wait_terminal(client, ["cancel-me"], timeout_s=30)
            async with http.get(f"{gateway}/v1/jobs/cancel-me") as resp:
                view = await resp.json()
    finally:
        await client.aclose()
    assert views["cancel-me"]["status"] == view["status"] == "cancelled"
    output = view["output"]
    assert output is not None and output["finish_reason"] == "abort"
    assert 0 < len(output["token_ids"]) == view["usage"]["completion_tokens"] < 1500
    (expected,) = engine.generate([LONG["prompt"]], SamplingParams(
        max_tokens=len(output["token_ids"]), ignore_eos=True, temperature=0))
    assert output["token_ids"] == expected.token_ids and output["text"] == expected.text
