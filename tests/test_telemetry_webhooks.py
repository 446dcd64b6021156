"""Webhook outcomes reach the gateway's /metrics through the dispatcher's attempt observer."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from gateway.metrics import GatewayMetrics
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.dispatcher import WebhookDispatcher
from scheduler.keys import Keys
from scheduler.webhooks import delivery_fields
from telemetry_support import in_memory_telemetry, value
from webhook_receiver import Answer, Receiver

KEYS = Keys("whmetrics")


async def test_attempt_outcomes_are_counted(redis_url: str) -> None:
    secret = generate_secret()
    config = WebhookConfig(
        webhook_secret=secret, webhook_allow=["127.0.0.1"], webhook_timeout_s=2.0,
        webhook_retry_schedule_s=[0.1, 0.2], webhook_jitter=0.0, webhook_poll_s=0.02, webhook_drain_s=1.0,
    )
    telemetry, _ = in_memory_telemetry("carpool-gateway")
    metrics = GatewayMetrics(telemetry)
    receiver = await Receiver(secret, [Answer(500)], then=Answer(200)).start()
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.hset(KEYS.job("j1"), mapping={"id": "j1", "status": "running"})
        fields = delivery_fields("j1", "completed", receiver.url, {"id": "j1", "status": "succeeded"}, now=time.time())
        await client.xadd(KEYS.webhooks, fields)  # type: ignore[arg-type]
        async with WebhookDispatcher(client, KEYS, config, observer=metrics):
            await asyncio.wait_for(receiver.accepted.wait(), 10)
            deadline = time.monotonic() + 5
            while value(metrics.render().decode(), "carpool_webhook_deliveries_total",
                        carpool_webhook_outcome="delivered") < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
    finally:
        await receiver.stop()
        await client.aclose()
    text = metrics.render().decode()
    labels = {"carpool_webhook_event": "completed"}
    assert value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="retrying", **labels) == 1
    assert value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="delivered", **labels) == 1
    assert value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="dead") == 0
    assert value(text, "carpool_webhook_delivery_duration_seconds_count") == 2
    telemetry.shutdown()
