"""Gateway telemetry: /metrics series from the real app, enqueue spans and the traceparent in the job message."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway import appkeys
from gateway.access_log import AccessLogger
from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import Keys
from scheduler.telemetry.metric_schema import GATEWAY_METRICS
from scheduler.telemetry.otel import Telemetry
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.telemetry_support import in_memory_telemetry, json_logs, sample_names, value
from tests.harness.worker_harness import wait_until

KEYS = Keys()
PRODUCER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[tuple[TestClient, Telemetry, InMemorySpanExporter]]:
    telemetry, spans = in_memory_telemetry("carpool-gateway")
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, max_lane_depth={"batch": 2})
    async with TestClient(GatewayTestServer(init_app(config, telemetry))) as client:
        yield client, telemetry, spans
    telemetry.shutdown()


async def lane_messages(redis_url: str, lane: str) -> list[JobSpec]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = await client.xrange(KEYS.lane(lane))
    finally:
        await client.aclose()
    return [JobSpec.unpack(fields[b"job"]) for _, fields in entries]


async def test_scrape_counts_submissions_and_rejections(
    gateway: tuple[TestClient, Telemetry, InMemorySpanExporter], redis_url: str
) -> None:
    client, _, _ = gateway
    for i in range(3):
        resp = await client.post("/v1/jobs", json={"prompt": f"hi {i}"})
        assert resp.status == 202
    for _ in range(3):  # the third overflows the batch lane (max depth 2)
        await client.post("/v1/jobs", json={"prompt": "bulk", "lane": "batch"})
    assert (await client.post("/v1/jobs", json={"prompt": ""})).status == 400
    assert (await client.post("/v1/jobs", json={"prompt": "", "lane": "interactive"})).status == 400
    resp = await client.post("/v1/jobs", json={"id": "same", "prompt": "x"})
    assert resp.status == 202
    assert (await client.post("/v1/jobs", json={"id": "same", "prompt": "x"})).status == 200
    await client.app[appkeys.METRICS].streams.refresh()

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await resp.text()
    assert value(text, "carpool_jobs_submitted_total", carpool_lane="standard") == 4
    assert value(text, "carpool_jobs_submitted_total", carpool_lane="batch") == 2
    assert value(text, "carpool_jobs_rejected_total", carpool_reject_reason="lane_full", carpool_lane="batch") == 1
    # Refused before a job exists: labelled with the lane the body named, where it named one.
    assert value(text, "carpool_jobs_rejected_total", carpool_reject_reason="invalid", carpool_lane="unknown") == 1
    assert value(text, "carpool_jobs_rejected_total", carpool_reject_reason="invalid", carpool_lane="interactive") == 1
    for reason in ("rate_limited", "quota", "conflict"):  # at 0 from start-up, as every lane's lane_full is
        assert value(text, "carpool_jobs_rejected_total", carpool_reject_reason=reason, carpool_lane="interactive") == 0
    assert value(text, "carpool_jobs_deduplicated_total") == 1
    assert value(text, "carpool_queue_depth", carpool_lane="standard") == 4
    assert value(text, "carpool_queue_depth", carpool_lane="batch") == 2
    assert value(text, "carpool_queue_pending", carpool_lane="standard") == 0
    assert value(text, "carpool_dead_letter_depth") == 0
    assert value(text, "http_server_request_duration_seconds_count", http_route="/v1/jobs") == 10
    assert value(text, "target_info", service_name="carpool-gateway") == 1

    names = sample_names(text)
    assert value(text, "carpool_jobs_cancelled_total") == 0
    assert value(text, "carpool_gateway_open_waiters") == 0
    webhook_series = {"carpool.webhook.deliveries", "carpool.webhook.delivery.duration"}  # dispatcher off here
    for spec in GATEWAY_METRICS:
        if spec.name not in webhook_series:
            assert set(spec.prometheus_names) <= names, spec.name


async def test_job_message_carries_the_trace_of_the_request(
    gateway: tuple[TestClient, Telemetry, InMemorySpanExporter], redis_url: str
) -> None:
    client, _, spans = gateway
    header = f"00-{PRODUCER_TRACE_ID}-{PRODUCER_SPAN_ID}-01"
    assert (await client.post("/v1/jobs", json={"id": "a", "prompt": "x"}, headers={"traceparent": header})).status == 202
    body_parent = "00-11111111111111111111111111111111-2222222222222222-01"
    assert (await client.post("/v1/jobs", json={"id": "b", "prompt": "x", "traceparent": body_parent})).status == 202
    assert (await client.post("/v1/jobs", json={"id": "c", "prompt": "x"})).status == 202

    by_id = {spec.id: spec for spec in await lane_messages(redis_url, "standard")}
    enqueue = {s.attributes["carpool.job.id"]: s for s in spans.get_finished_spans() if s.name == "carpool.enqueue"}
    assert sorted(enqueue) == ["a", "b", "c"]
    for job_id, spec in by_id.items():
        span = enqueue[job_id]
        assert spec.traceparent is not None
        assert spec.traceparent.split("-")[1:3] == [f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"]
    # a: the header's trace, under the HTTP server span that continued it
    server_a = next(s for s in spans.get_finished_spans() if s.name == "POST /v1/jobs"
                    and s.context.trace_id == enqueue["a"].context.trace_id)
    assert f"{server_a.context.trace_id:032x}" == PRODUCER_TRACE_ID
    assert server_a.parent is not None and server_a.parent.span_id == int(PRODUCER_SPAN_ID, 16)
    assert enqueue["a"].parent is not None and enqueue["a"].parent.span_id == server_a.context.span_id
    # b: the producer's traceparent in the body is the job's parent, and the request's trace is linked to it
    assert f"{enqueue['b'].context.trace_id:032x}" == "11111111111111111111111111111111"
    assert enqueue["b"].parent is not None and enqueue["b"].parent.span_id == 0x2222222222222222
    servers = {s.context.span_id: s for s in spans.get_finished_spans() if s.name == "POST /v1/jobs"}
    [link] = enqueue["b"].links
    assert link.context.span_id in servers and link.context.trace_id != enqueue["b"].context.trace_id
    assert not enqueue["a"].links and not enqueue["c"].links
    # c: a fresh trace rooted at the gateway's server span
    assert enqueue["c"].context.trace_id not in {enqueue["a"].context.trace_id, enqueue["b"].context.trace_id}
    assert not any(s.name == "GET /metrics" for s in spans.get_finished_spans())


async def test_an_enqueue_span_says_what_came_of_it(gateway: tuple[TestClient, Telemetry, InMemorySpanExporter]
                                                    ) -> None:
    """Enqueued, a repeat of a job already there, or refused by a full lane: said on the span, the refusal as its
    error, not as a job put on its lane."""
    from opentelemetry.trace import StatusCode

    client, _, spans = gateway
    for body in ({"id": "first", "prompt": "x", "lane": "batch"}, {"id": "first", "prompt": "x", "lane": "batch"},
                 {"id": "second", "prompt": "x", "lane": "batch"}, {"id": "third", "prompt": "x", "lane": "batch"}):
        await client.post("/v1/jobs", json=body)
    enqueues = [s for s in spans.get_finished_spans() if s.name == "carpool.enqueue"]
    said = [(s.attributes["carpool.job.id"], s.attributes["carpool.enqueue.outcome"], s.status.status_code)
            for s in enqueues]
    assert said == [("first", "enqueued", StatusCode.UNSET), ("first", "exists", StatusCode.UNSET),
                    ("second", "enqueued", StatusCode.UNSET), ("third", "full", StatusCode.ERROR)], said


async def test_an_answers_request_id_finds_its_trace(
    gateway: tuple[TestClient, Telemetry, InMemorySpanExporter]
) -> None:
    client, _, spans = gateway
    answers = [await client.post("/v1/jobs", json={"id": "r1", "prompt": "x"}),
               await client.post("/v1/jobs", json={"prompt": 5}),
               await client.get("/v1/jobs/no-such-job")]
    ids = [answer.headers["x-request-id"] for answer in answers]
    assert [a.status for a in answers] == [202, 400, 404] and len(set(ids)) == 3
    servers = [s for s in spans.get_finished_spans() if s.kind.name == "SERVER"]
    by_id = {s.attributes["http.response.header.x-request-id"]: s for s in servers}
    assert [by_id[i].attributes["http.response.status_code"] for i in ids] == [202, 400, 404]


async def test_each_answered_request_logs_one_access_line_naming_its_job_and_trace(redis_url: str) -> None:
    """The access line is written after the request's span has ended: it still names the job, the request's
    trace (the one the job message carries) and the answer's ``x-request-id``; a file or batch route's id is
    not taken for a job's, and a probe logs only at debug."""
    telemetry, _ = in_memory_telemetry("carpool-gateway")
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True)
    server = GatewayTestServer(init_app(config, telemetry))
    with json_logs("aiohttp.access", "carpool-gateway") as stream:
        await server.start_server(access_log_class=AccessLogger)  # as `carpool gateway` serves it
        async with TestClient(server) as client:
            made = await client.post("/v1/jobs", json={"id": "logged-1", "prompt": "x"},
                                     headers={"User-Agent": "producer/1.0"})
            read = await client.get("/v1/jobs/logged-1")
            missing_file = await client.get("/v1/files/file-nope")
            probe = await client.get("/healthz")
    telemetry.shutdown()
    assert (made.status, read.status, missing_file.status, probe.status) == (202, 200, 404, 200)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["http_method"], line["http_path"], line["http_status"]) for line in lines] == [
        ("POST", "/v1/jobs", 202), ("GET", "/v1/jobs/logged-1", 200), ("GET", "/v1/files/file-nope", 404)]
    post, get, file_line = lines
    (message,) = await lane_messages(redis_url, "standard")
    assert post["job_id"] == get["job_id"] == "logged-1" and post["user_agent"] == "producer/1.0"
    assert post["trace_id"] == message.traceparent.split("-")[1] and get["trace_id"] != post["trace_id"]
    assert post["request_id"] == made.headers["x-request-id"] and post["message"].startswith("POST /v1/jobs 202 ")
    assert file_line["file_id"] == "file-nope" and "job_id" not in file_line
    assert all(line["level"] == "info" and line["duration_ms"] >= 0 for line in lines)


async def test_a_batch_lines_trace_links_to_the_request_that_created_its_batch(
    gateway: tuple[TestClient, Telemetry, InMemorySpanExporter], redis_url: str
) -> None:
    """Each line of a batch is a job with a trace of its own (a batch of 50,000 lines is not one trace), and its
    enqueue span links to the span of the request that created the batch: a line's trace leads to its batch's."""
    client, _, spans = gateway
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "hi", "max_tokens": 2}} for i in range(2)]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "\n".join(json.dumps(line) for line in lines).encode(), filename="in.jsonl")
    uploaded = await (await client.post("/v1/files", data=form)).json()
    created = await client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                                                     "completion_window": "24h"},
                                headers={"traceparent": f"00-{PRODUCER_TRACE_ID}-{PRODUCER_SPAN_ID}-01"})
    assert created.status == 200, await created.text()
    batch_id = (await created.json())["id"]

    def line_enqueues() -> list[Any]:
        return [s for s in spans.get_finished_spans()
                if s.name == "carpool.enqueue" and str(s.attributes["carpool.job.id"]).startswith(batch_id)]

    await wait_until(lambda: len(line_enqueues()) == 2, "both lines enqueued by the batch driver")
    (create_span,) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/batches"]
    assert f"{create_span.context.trace_id:032x}" == PRODUCER_TRACE_ID
    enqueues = line_enqueues()
    assert len({s.context.trace_id for s in enqueues}) == 2  # a trace each, neither the batch's
    for span in enqueues:
        assert span.parent is None and span.context.trace_id != create_span.context.trace_id
        (link,) = span.links
        assert (link.context.trace_id, link.context.span_id) == (create_span.context.trace_id,
                                                                 create_span.context.span_id)
    messages = await lane_messages(redis_url, "batch")
    assert {m.traceparent.split("-")[1] for m in messages} == {f"{s.context.trace_id:032x}" for s in enqueues}


def test_the_gateways_tenant_series_keep_to_its_max_tenant_labels() -> None:
    """Workers and gateways name tenants alike: with `--max-tenant-labels 0`, no tenant's name."""
    from gateway.metrics import GatewayMetrics

    telemetry, _ = in_memory_telemetry("carpool-gateway")
    metrics = GatewayMetrics(telemetry, max_tenant_labels=0)
    metrics.job_cancelled_queued("standard", "acme")
    text = metrics.render().decode()
    telemetry.shutdown()
    assert value(text, "carpool_tenant_jobs_total", carpool_tenant="_other", carpool_job_status="cancelled") == 1
    assert 'carpool_tenant="acme"' not in text
    assert value(text, "carpool_jobs_finished_total", carpool_lane="standard", carpool_job_status="cancelled") == 1
