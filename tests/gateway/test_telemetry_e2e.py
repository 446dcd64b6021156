"""Gateway and worker together: /metrics on both counts what ran, and each job is one trace across both.

Both run in the test's event loop, each with its own ``Telemetry`` (own meter
and tracer providers, own Prometheus registry, own in-memory span exporter),
which is how two processes see it: nothing is shared between the two.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway import appkeys
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from scheduler.telemetry.metric_schema import GATEWAY_METRICS, WORKER_METRICS
from tests.deploy.test_telemetry_dashboard import load_dashboard, queries, series_in
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.telemetry_support import in_memory_telemetry, is_connected, sample_names, spans_by_trace, value
from tests.harness.webhook_receiver import Receiver
from tests.harness.worker_harness import WAIT_S, wait_until
from worker.config import WorkerConfig
from worker.engine.tick import EngineThread
from worker.service import WorkerService

NUM_JOBS = 4
PRODUCER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PRODUCER_SPAN_ID = "b7ad6b7169203331"
WEBHOOK_JOB = 1  # this one asks for every webhook event; the dispatcher runs in the gateway


async def scrape(client: TestClient) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return await resp.text()


async def wait_for(client: TestClient, name: str, expected: float, **labels: str) -> str:
    """Scrape until a sample reaches ``expected`` (the worker records right after its commit returns)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        text = await scrape(client)
        if value(text, name, **labels) == expected or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.01)


async def test_metrics_and_traces_from_gateway_to_worker(redis_url: str, tiny_model: Any) -> None:
    from worker.engine.engine import Engine

    gw_telemetry, gw_spans = in_memory_telemetry("carpool-gateway")
    wk_telemetry, wk_spans = in_memory_telemetry("carpool-worker")
    engine = Engine(model=tiny_model(), max_num_seqs=8)
    config = WorkerConfig.of(redis_url=redis_url, metrics_port=0, max_wait_ms=5.0, max_num_seqs=8)
    redis_client = aioredis.Redis.from_url(redis_url)
    worker = WorkerService(config, EngineThread(engine), redis_client, telemetry=wk_telemetry)
    await worker.start()
    secret = generate_secret()
    receiver = await Receiver(secret).start()
    webhooks = WebhookConfig(webhook_secret=secret, webhook_allow=["127.0.0.1"], webhook_poll_s=0.02)
    gateway = TestClient(GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, webhooks=webhooks), gw_telemetry)))
    worker_http = TestClient(GatewayTestServer(worker.http_app()))
    await gateway.start_server()
    await worker_http.start_server()
    try:
        ids = []
        for i in range(NUM_JOBS):
            headers = {"traceparent": f"00-{PRODUCER_TRACE_ID}-{PRODUCER_SPAN_ID}-01"} if i == 0 else {}
            body = {"prompt": f"telemetry {i} " + "y" * i, "lane": ["interactive", "standard"][i % 2],
                    "params": {"max_tokens": 3 + i, "temperature": 0.0, "ignore_eos": True}}
            if i == WEBHOOK_JOB:
                body["webhook"] = {"url": receiver.url}
            resp = await gateway.post("/v1/jobs", json=body, headers=headers)
            assert resp.status == 202
            ids.append((await resp.json())["id"])
        views = {}
        for job_id in ids:
            resp = await gateway.get(f"/v1/jobs/{job_id}", params={"wait": "60"})
            views[job_id] = await resp.json()
            assert views[job_id]["status"] == "succeeded", views[job_id]
        completion = sum(v["usage"]["completion_tokens"] for v in views.values())
        prompt = sum(v["usage"]["prompt_tokens"] for v in views.values())
        assert completion == sum(3 + i for i in range(NUM_JOBS))
        await asyncio.wait_for(receiver.accepted.wait(), WAIT_S)
        await wait_until(lambda: any(r.payload["type"] == "completed" for r in receiver.received),
                         "the completed webhook")
        webhook_events = [r.payload["type"] for r in receiver.received]
        assert webhook_events[0] == "started" and webhook_events[-1] == "completed", webhook_events

        await worker.metrics.streams.refresh()
        wk_text = await wait_for(worker_http, "carpool_jobs_finished_total", NUM_JOBS)
        await gateway.app[appkeys.METRICS].streams.refresh()
        gw_text = await scrape(gateway)
        stats = engine.stats()
    finally:
        await gateway.close()
        await worker_http.close()
        await worker.shutdown()
        await receiver.stop()
        await redis_client.aclose()

    # gateway: N submissions, per lane
    assert value(gw_text, "carpool_jobs_submitted_total") == NUM_JOBS
    assert value(gw_text, "carpool_jobs_submitted_total", carpool_lane="interactive") == NUM_JOBS // 2
    assert value(gw_text, "carpool_queue_depth") == 0
    # worker: N finished jobs and exactly their tokens
    assert value(wk_text, "carpool_jobs_finished_total", carpool_job_status="succeeded") == NUM_JOBS
    assert value(wk_text, "gen_ai_client_token_usage_count", gen_ai_token_type="output") == NUM_JOBS
    assert value(wk_text, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == completion
    assert value(wk_text, "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == prompt
    for name in ("gen_ai_server_time_to_first_token_seconds_count", "gen_ai_server_time_per_output_token_seconds_count",
                 "gen_ai_server_request_duration_seconds_count", "carpool_job_queue_wait_seconds_count"):
        assert value(wk_text, name) == NUM_JOBS, name
    # one inter-token sample per output token after each job's first
    assert value(wk_text, "carpool_inter_token_latency_seconds_count") == completion - NUM_JOBS
    assert value(wk_text, "carpool_inter_token_latency_seconds_count", carpool_lane="standard") == sum(
        2 + i for i in range(NUM_JOBS) if i % 2)
    assert value(wk_text, "carpool_inter_token_latency_seconds_sum") > 0
    assert value(wk_text, "carpool_engine_step_duration_seconds_count") == stats.num_steps > 0
    assert value(wk_text, "carpool_engine_step_tokens_sum") >= prompt + completion - NUM_JOBS
    assert value(wk_text, "carpool_engine_sequences_running") == 0
    assert value(wk_text, "carpool_engine_preemptions_total") == stats.num_preemptions
    assert value(wk_text, "carpool_queue_pending") == 0
    assert value(wk_text, "target_info", service_name="carpool-worker") == 1
    for specs, text in ((GATEWAY_METRICS, gw_text), (WORKER_METRICS, wk_text)):
        names = sample_names(text)
        for spec in specs:
            assert set(spec.prometheus_names) <= names, spec.name

    # the dashboard reads only series these scrapes expose
    scraped = sample_names(gw_text) | sample_names(wk_text)
    used = set().union(*(series_in(expr) for expr in queries(load_dashboard())))
    assert used <= scraped, sorted(used - scraped)

    # traces: one per job, spans from both processes, connected
    gw_by_trace = spans_by_trace(gw_spans.get_finished_spans())
    wk_by_trace = spans_by_trace(wk_spans.get_finished_spans())
    for i, job_id in enumerate(ids):
        enqueue = next(s for s in gw_spans.get_finished_spans()
                       if s.name == "carpool.enqueue" and s.attributes["carpool.job.id"] == job_id)
        trace_id = enqueue.context.trace_id
        gw, wk = gw_by_trace[trace_id], wk_by_trace[trace_id]
        names = {s.name for s in gw + wk}
        assert {"POST /v1/jobs", "carpool.enqueue", "carpool.queue_wait", "carpool.job", "carpool.admission",
                "carpool.prefill", "carpool.decode", "carpool.result.publish"} <= names
        assert {s.resource.attributes["service.name"] for s in gw} == {"carpool-gateway"}
        assert {s.resource.attributes["service.name"] for s in wk} == {"carpool-worker"}
        job_span = next(s for s in wk if s.name == "carpool.job")
        assert job_span.parent is not None and job_span.parent.span_id == enqueue.context.span_id
        if i == 0:
            assert f"{trace_id:032x}" == PRODUCER_TRACE_ID
            assert is_connected(gw + wk, remote_parent_span_id=int(PRODUCER_SPAN_ID, 16))
        else:
            assert is_connected(gw + wk)
        deliveries = [s for s in gw if s.name == "carpool.webhook.deliver"]
        if i != WEBHOOK_JOB:
            assert deliveries == []
            continue
        # every attempt the receiver saw is a client span of this job's trace, under the worker's spans
        assert sorted(s.attributes["carpool.webhook.event"] for s in deliveries) == sorted(webhook_events)
        for s in deliveries:
            assert s.attributes["carpool.webhook.attempt"] == 1
            assert s.attributes["http.response.status_code"] == 200
            assert s.attributes["carpool.webhook.outcome"] == "delivered"
            assert s.attributes["carpool.job.id"] == job_id
        completed = next(s for s in deliveries if s.attributes["carpool.webhook.event"] == "completed")
        assert completed.parent.span_id == job_span.context.span_id
    gw_telemetry.shutdown()
    wk_telemetry.shutdown()
