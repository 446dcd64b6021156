"""A lane entry whose webhook.url no dispatcher could ever send to is an invalid job at the worker's intake:
failed with the field named and dead-lettered, never run, and no callback is queued for it."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from scheduler.protocol.lanes import Lane
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, wait_until

BAD_URLS = {
    "ftp": "ftp://x",
    "integer-host": "http://2130706433:8290/hook",
    "no-host": "http:///hook",
}


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


async def test_bad_webhook_urls_are_invalid_jobs_at_intake(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane(Lane.STANDARD)
    good = {"v": 1, "id": "good", "prompt": "x", "params": {"max_tokens": 2, "temperature": 0},
            "webhook": {"url": "http://192.168.1.1/x", "events": ["completed"]}}
    async with running_worker(redis_url, engine):
        for job_id, url in BAD_URLS.items():
            body = {"v": 1, "id": job_id, "prompt": "x", "params": {"max_tokens": 2}, "webhook": {"url": url}}
            await client.xadd(lane, {"job": json.dumps(body)})
        await client.xadd(lane, {"job": json.dumps(good)})
        views = await wait_terminal(client, [*BAD_URLS, "good"])
        await wait_until(lambda: client.xlen(KEYS.webhooks), "the good job's callback queued")

    for job_id in BAD_URLS:
        view = views[job_id]
        assert view["status"] == "failed", view
        assert view["error"]["type"] == "invalid_job" and view["error"]["field"] == "webhook.url", view["error"]
        assert view["output"] is None or not view["output"].get("text")
    assert "scheme must be http or https, got 'ftp'" in views["ftp"]["error"]["message"]
    assert "dotted-decimal" in views["integer-host"]["error"]["message"]
    reasons = [fields[b"reason"].decode() for _, fields in await client.xrange(KEYS.dead)]
    assert len(reasons) == len(BAD_URLS) and all(r.startswith("invalid job: webhook.url:") for r in reasons), reasons
    # The address rules are the deployment's, applied by the dispatcher: a well-formed private URL runs.
    assert views["good"]["status"] == "succeeded"
    callbacks = [fields for _, fields in await client.xrange(KEYS.webhooks)]
    assert [(c[b"job_id"], c[b"event"], c[b"url"]) for c in callbacks] == [(b"good", b"completed", b"http://192.168.1.1/x")]
    await client.aclose()
