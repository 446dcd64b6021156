"""The whole service: a gateway on a real port and a worker on one Redis, jobs arriving both ways.

40 jobs are POSTed over HTTP and 40 XADDed straight onto the lanes as msgpack,
spread over the three lanes, every third with a ``reply_to`` stream. All must
succeed with exactly the greedy output of the offline engine, carry their
timings, and leave exactly one result per job on their reply stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.job import JobSpec
from scheduler.protocol.lanes import LANES
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import running_worker, wait_terminal, xadd_job

NUM_PER_SOURCE = 40
REPLY_STREAMS = {"http": "e2e:replies:http", "direct": "e2e:replies:direct"}


def job_body(source: str, i: int) -> dict[str, Any]:
    """The wire map of job `i` from `source`: lanes cycle; every third job (covering all three lanes) replies."""
    body: dict[str, Any] = {
        "id": f"{source}-{i}",
        "prompt": f"{source} job {i}: " + "abcdefgh"[: i % 8],
        "params": {"max_tokens": 6 + i % 5, "temperature": 0, "ignore_eos": True},
        "lane": LANES[i % 3].value,
        "metadata": {"source": source, "i": i},
    }
    if i % 9 in (0, 4, 8):
        body["reply_to"] = REPLY_STREAMS[source]
    return body


BODIES = [job_body(source, i) for source in ("http", "direct") for i in range(NUM_PER_SOURCE)]


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[TestClient]:
    """The gateway's aiohttp app on a free 127.0.0.1 port, spoken to over real HTTP."""
    client = TestClient(GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)), host="127.0.0.1"))
    await client.start_server()
    yield client
    await client.close()


async def test_forty_over_http_and_forty_xadded_all_succeed_like_the_offline_engine(
    redis_url: str, gateway: TestClient, tiny_model
) -> None:
    from worker.engine.engine import Engine

    model = tiny_model()
    specs = [JobSpec.from_wire(body) for body in BODIES]
    offline = Engine(model=model, max_num_seqs=16).generate([s.prompt for s in specs], [s.params for s in specs])
    expected = {spec.id: completion for spec, completion in zip(specs, offline)}

    client = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(redis_url, Engine(model=model, max_num_seqs=16)):

            async def post(body: dict[str, Any]) -> None:
                resp = await gateway.post("/v1/jobs", json=body)
                assert resp.status == 202, await resp.text()
                assert (await resp.json())["id"] == body["id"]

            http_jobs = [post(b) for b in BODIES if b["metadata"]["source"] == "http"]
            direct_jobs = [xadd_job(client, s) for s in specs if s.metadata and s.metadata["source"] == "direct"]
            await asyncio.gather(*http_jobs, *direct_jobs)
            await wait_terminal(client, expected)
            views = {}
            for job_id in expected:
                resp = await gateway.get(f"/v1/jobs/{job_id}")
                assert resp.status == 200
                views[job_id] = await resp.json()
        replies = {source: await client.xrange(stream) for source, stream in REPLY_STREAMS.items()}
    finally:
        await client.aclose()

    assert len(views) == 2 * NUM_PER_SOURCE
    for spec in specs:
        view, want = views[spec.id], expected[spec.id]
        assert view["status"] == "succeeded", (spec.id, view["error"])
        assert view["lane"] == spec.lane.value and view["metadata"] == spec.metadata
        assert view["output"]["token_ids"] == want.token_ids, spec.id
        assert view["output"]["text"] == want.text and len(want.token_ids) == spec.params.max_tokens
        assert view["usage"]["completion_tokens"] == spec.params.max_tokens
        timings = view["timings"]
        assert all(timings[name] is not None and timings[name] >= 0 for name in ("queued_s", "ttft_s", "e2e_s")), timings
        assert timings["queued_s"] <= timings["ttft_s"] <= timings["e2e_s"]

    for source, stream in REPLY_STREAMS.items():
        results = [msgpack.unpackb(fields[b"result"], raw=False) for _, fields in replies[source]]
        replying = [b for b in BODIES if b.get("reply_to") == stream]
        assert len(replying) == 13 and {b["lane"] for b in replying} == {lane.value for lane in LANES}
        wanted = sorted(b["id"] for b in replying)
        assert sorted(r["id"] for r in results) == wanted, "exactly one result per job on its reply stream"
        for result in results:
            assert result["status"] == "succeeded"
            assert result["output"] == views[result["id"]]["output"]
            assert result.keys() == views[result["id"]].keys()
