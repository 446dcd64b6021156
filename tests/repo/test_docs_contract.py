"""What the README promises about job ids and lanes is what a real gateway and worker do."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession

from worker.config import WorkerConfig
from worker.engine.engine import Engine
from worker.engine.tick import EngineThread
from worker.service import WorkerService

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _row(field: str) -> str:
    (row,) = [line for line in README.splitlines() if line.startswith(f"| `{field}` |")]
    return row


async def test_the_documented_id_set_is_what_the_gateway_accepts(gateway_url: str) -> None:
    row = _row("id")
    assert "1–128 characters, each printable and not whitespace" in row and "spaces" in row
    accepted = ["order-42", "a" * 128, "ordre:été@eu_1.x", "注文-7"]
    refused = ["order 42", "tab\there", "new\nline", "bell\x07", "a" * 129, ""]
    async with ClientSession() as http:
        for job_id in accepted + refused:
            async with http.post(f"{gateway_url}/v1/jobs", json={"id": job_id, "prompt": "hi"}) as resp:
                body = await resp.json()
            if job_id in accepted:
                assert resp.status == 202, (job_id, body)
            else:
                assert resp.status == 400 and body["error"]["field"] == "id", (job_id, body)


@pytest.mark.slow
async def test_only_the_three_documented_lanes_are_read(redis_url: str, tiny_model: Callable[..., str]) -> None:
    row = _row("lane")
    assert "Workers read only these three streams" in row and "`carpool:lane:urgent`" in row
    client = aioredis.Redis.from_url(redis_url)
    config = WorkerConfig.of(redis_url=redis_url, model=tiny_model("llama"), metrics_port=0, engine_process=False,
                          read_block_ms=50)
    service = WorkerService(config, EngineThread(Engine(config.engine)), client)
    job = b'{"v":1,"id":"urgent-1","prompt":"hi","params":{"max_tokens":2}}'
    try:
        await service.start()
        await client.xadd("carpool:lane:urgent", {"job": job})
        await client.xadd("carpool:lane:standard", {"job": job.replace(b"urgent-1", b"standard-1")})
        for _ in range(600):
            if await client.hget("carpool:job:standard-1", "status") == b"succeeded":
                break
            await asyncio.sleep(0.05)
        assert await client.hget("carpool:job:standard-1", "status") == b"succeeded"
        assert not await client.exists("carpool:job:urgent-1")
        assert await client.xlen("carpool:lane:urgent") == 1 and await client.xlen("carpool:dead") == 0
    finally:
        service.stopped.set()
        await service.shutdown()
        await client.aclose()
