"""Webhook outcomes reach /metrics through the dispatcher's attempt observer, in the gateway or on their own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis.asyncio as aioredis

from gateway.cli.embedded_redis import free_port
from gateway.metrics import GatewayMetrics
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.dispatcher import WebhookDispatcher
from scheduler.protocol.keys import Keys
from scheduler.protocol.webhooks import delivery_fields
from tests.harness.child_env import child_pythonpath
from tests.harness.telemetry_support import in_memory_telemetry, value
from tests.harness.webhook_receiver import Answer, Receiver
from tests.harness.worker_harness import WAIT_S, wait_until

KEYS = Keys("whmetrics")


async def test_attempt_outcomes_are_counted(redis_url: str) -> None:
    secret = generate_secret()
    config = WebhookConfig(
        webhook_secret=secret, webhook_allow=["127.0.0.1"], webhook_timeout_s=30.0,
        webhook_retry_schedule_s=[0.1, 0.2], webhook_jitter=0.0, webhook_poll_s=0.02, webhook_drain_s=1.0,
    )
    telemetry, spans = in_memory_telemetry("carpool-gateway")
    metrics = GatewayMetrics(telemetry)
    receiver = await Receiver(secret, [Answer(500)], then=Answer(200)).start()
    client = aioredis.Redis.from_url(redis_url)
    # A receiver's credentials and token in its URL never reach a span.
    url = receiver.url.replace("http://", "http://hook-user:pa55word@", 1) + "?token=SECRETTOKEN&v=2"
    try:
        await client.hset(KEYS.job("j1"), mapping={"id": "j1", "status": "running"})
        fields = delivery_fields("j1", "completed", url, {"id": "j1", "status": "succeeded"}, now=time.time())
        await client.xadd(KEYS.webhooks, fields)  # type: ignore[arg-type]
        async with WebhookDispatcher(client, KEYS, config, observer=metrics):
            await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
            await wait_until(lambda: value(metrics.render().decode(), "carpool_webhook_deliveries_total",
                                           carpool_webhook_outcome="delivered") >= 1, "the delivered count")
    finally:
        await receiver.stop()
        await client.aclose()
    text = metrics.render().decode()
    labels = {"carpool_webhook_event": "completed"}
    assert value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="retrying", **labels) == 1
    assert value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="delivered", **labels) == 1
    assert value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="dead") == 0
    assert value(text, "carpool_webhook_delivery_duration_seconds_count") == 2
    delivered = [span for span in spans.get_finished_spans() if span.name == "carpool.webhook.deliver"]
    assert len(delivered) == 2
    for span in delivered:
        assert span.attributes["url.full"] == (receiver.url.replace("http://", "http://REDACTED:REDACTED@", 1)
                                               + "?token=REDACTED&v=REDACTED")
        assert not any(secret_text in str(v) for v in span.attributes.values()
                       for secret_text in ("pa55word", "SECRETTOKEN", "hook-user"))
    telemetry.shutdown()


REPO = Path(__file__).resolve().parents[3]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_standalone_dispatcher_serves_metrics_and_health(redis_url: str, tmp_path: Path) -> None:
    secret = generate_secret()
    receiver = await Receiver(secret).start()
    # Picked once the receiver holds its own port: a port picked first and let go could be the one the receiver is
    # then given, and /metrics would ask the receiver (404).
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env.update(PYTHONPATH=child_pythonpath(REPO), CARPOOL_WEBHOOK_SECRET=secret, CARPOOL_WEBHOOK_ALLOW="127.0.0.1",
               CARPOOL_WEBHOOK_POLL_S="0.02", CARPOOL_KEY_PREFIX=KEYS.prefix)
    stderr_path = tmp_path / "webhooks.log"
    client = aioredis.Redis.from_url(redis_url)
    with open(stderr_path, "w") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "webhooks", "--redis-url", redis_url, "--metrics-host", "127.0.0.1",
            "--metrics-port", str(port), cwd=REPO, env=env, stderr=stderr,
        )
    try:
        fields = delivery_fields("j2", "completed", receiver.url, {"id": "j2"}, now=time.time())
        await client.xadd(KEYS.webhooks, fields)  # type: ignore[arg-type]
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:
            status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
            if value(text, "carpool_webhook_deliveries_total", carpool_webhook_outcome="delivered") == 1:
                break
            assert time.monotonic() < deadline, text
            await asyncio.sleep(0.05)
        assert status == 200
        assert value(text, "carpool_webhook_delivery_duration_seconds_count") == 1
        assert value(text, "target_info", service_name="carpool-webhooks") == 1
        assert "carpool_jobs_submitted_total" not in text  # only the dispatcher's own series
        status, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/healthz")
        assert (status, json.loads(body)) == (200, {"status": "ok"})
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
        await receiver.stop()
        await client.aclose()
    log = stderr_path.read_text()
    assert code == 0, log
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert records and all(r["service"] == "carpool-webhooks" for r in records), log
    assert any("running on" in r["message"] for r in records)
