"""Structured logs: JSON lines naming the job and the trace of the work they are about."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from scheduler.telemetry.log_format import JsonFormatter, configure_logging, job_context
from tests.harness.telemetry_support import in_memory_telemetry


def capture() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(service="carpool-test"))
    logger = logging.getLogger("carpool.test.logs")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_each_line_names_its_own_job_and_trace_across_concurrent_tasks() -> None:
    logger, stream = capture()
    telemetry, _ = in_memory_telemetry("carpool-test")

    async def work(job_id: str) -> str:
        with telemetry.tracer.start_as_current_span("work") as span, job_context(job_id):
            for step in range(3):
                logger.info("step %d", step, extra={"step": step})
                await asyncio.sleep(0)
            return format(span.get_span_context().trace_id, "032x")

    trace_ids = await asyncio.gather(work("job-a"), work("job-b"))
    logger.info("not about a job")
    records = lines(stream)
    assert len(records) == 7
    for job_id, trace_id in zip(("job-a", "job-b"), trace_ids):
        mine = [r for r in records if r.get("job_id") == job_id]
        assert [r["step"] for r in mine] == [0, 1, 2]
        assert {r["trace_id"] for r in mine} == {trace_id}
        assert all(r["service"] == "carpool-test" and r["level"] == "info" for r in mine)
    assert "job_id" not in records[-1] and "trace_id" not in records[-1]
    assert records[-1]["message"] == "not about a job"
    telemetry.shutdown()


def test_job_context_with_a_span_and_exceptions() -> None:
    logger, stream = capture()
    telemetry, _ = in_memory_telemetry("carpool-test")
    span = telemetry.tracer.start_span("job")
    with job_context("job-x", span):
        try:
            raise ValueError("bad input")
        except ValueError:
            logger.exception("failed")
    span.end()
    (record,) = lines(stream)
    assert record["job_id"] == "job-x" and record["level"] == "error"
    assert record["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert "ValueError: bad input" in str(record["exc"])
    telemetry.shutdown()


def test_configure_logging_replaces_root_handlers() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        configure_logging("WARNING", stream=stream, service="carpool-worker")
        logging.getLogger("carpool.any").info("dropped")
        logging.getLogger("carpool.any").warning("kept")
        assert [json.loads(line)["message"] for line in stream.getvalue().splitlines()] == ["kept"]
        assert len(root.handlers) == 1
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)


def test_an_otlp_collector_that_does_not_answer_is_said_once_in_a_while_not_at_every_export() -> None:
    """A metrics exporter pushing every 100 ms to a port nothing listens on: the SDK's own warning and error of
    each failed export reach the log once (the next, 30 s on, says how many were left out), while carpool's own
    lines pass as they are."""
    import socket
    import time

    from scheduler.telemetry.otel import Telemetry, TelemetryConfig

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        configure_logging("INFO", stream=stream, service="carpool-worker")
        config = TelemetryConfig(service_name="s", otlp_metrics_endpoint=f"http://127.0.0.1:{port}/v1/metrics",
                                 metric_export_interval_ms=100, otlp_metrics_timeout_s=0.2)
        telemetry = Telemetry(config)
        telemetry.meter.create_counter("carpool.test.exports").add(1)  # something to export
        time.sleep(1.5)  # a dozen exports, each failing
        for _ in range(3):
            logging.getLogger("carpool.any").warning("kept")
        telemetry.shutdown()
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    sdk = [r for r in records if r["logger"].startswith("opentelemetry.")]
    assert sdk, "the failed exports are said"
    by_message = {(r["logger"], r["message"]) for r in sdk}
    assert len(sdk) == len(by_message) <= 4, [r["message"] for r in sdk]
    assert [r["message"] for r in records if r["logger"] == "carpool.any"] == ["kept"] * 3


def test_the_telemetry_log_throttle_says_how_many_it_left_out() -> None:
    from scheduler.telemetry.log_format import TelemetryLogThrottle

    now = [0.0]
    throttle = TelemetryLogThrottle(every_s=30.0, clock=lambda: now[0])

    def record(name: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, "Failed to export batch code: %s", (503,), None)

    passed = []
    for t in (0.0, 1.0, 2.0, 29.0, 31.0, 32.0):
        now[0] = t
        one = record("opentelemetry.exporter.otlp.proto.http.metric_exporter")
        if throttle.filter(one):
            passed.append((t, one.getMessage()))
    assert passed == [(0.0, "Failed to export batch code: 503"),
                      (31.0, "Failed to export batch code: 503 (3 more such since the last of these)")]
    assert all(throttle.filter(record("carpool.worker")) for _ in range(5))


async def test_the_lane_gauges_say_a_redis_outage_once_and_its_end_once(redis_url: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Polled every 20 ms through an outage: one warning (the next is due 30 s later), one line when Redis
    answers again, rather than a line per poll; the gauges report nothing while no refresh succeeds."""
    import redis.asyncio as aioredis

    from scheduler.protocol.keys import Keys
    from scheduler.telemetry.stream_stats import StreamStats
    from tests.harness.redis_proxy import RedisProxy

    from opentelemetry.metrics import CallbackOptions

    proxy = await RedisProxy(redis_url).start()
    client = aioredis.Redis.from_url(proxy.url, socket_timeout=1.0)
    stats = StreamStats(client, Keys(), interval_s=0.02)

    def lanes_reported() -> int:
        return len(list(stats.observe_depth(CallbackOptions())))

    reported = [lanes_reported()]  # before any refresh: nothing read, nothing reported
    with caplog.at_level(logging.INFO, logger="scheduler.telemetry.stream_stats"):
        stats.start()
        await asyncio.sleep(0.2)
        reported.append(lanes_reported())
        proxy.go_down()
        await asyncio.sleep(1.0)
        reported.append(lanes_reported())  # while Redis is away: no stale numbers
        proxy.restore()
        deadline = asyncio.get_running_loop().time() + 10
        while not any("available again" in r.getMessage() for r in caplog.records):
            assert asyncio.get_running_loop().time() < deadline, [r.getMessage() for r in caplog.records]
            await asyncio.sleep(0.05)
        reported.append(lanes_reported())
        await stats.aclose()
    await client.aclose()
    await proxy.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "Redis unavailable" in messages[0] and "available again" in messages[1], messages
    assert reported == [0, 3, 0, 3], reported


async def test_the_lane_gauges_count_entries_held_by_a_worker_no_longer_alive(redis_url: str) -> None:
    """`carpool_queue_unheld`: of a lane's pending entries, those delivered to a worker whose heartbeat stopped
    (here: one that never wrote one), which wait for another worker's reclaim."""
    import time

    import msgpack
    import redis.asyncio as aioredis

    from scheduler.protocol.keys import CONSUMER_GROUP, Keys
    from scheduler.protocol.lanes import Lane
    from scheduler.telemetry.stream_stats import StreamStats

    keys = Keys()
    client = aioredis.Redis.from_url(redis_url)
    lane = keys.lane(Lane.BATCH)
    await client.xgroup_create(lane, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(5):
        await client.xadd(lane, {"job": msgpack.packb({"id": f"j{i}", "prompt": "x"})})
    await client.xreadgroup(CONSUMER_GROUP, "alive", {lane: ">"}, count=1)
    await client.xreadgroup(CONSUMER_GROUP, "gone", {lane: ">"}, count=3)
    await client.hset(keys.workers, "alive", msgpack.packb({"time": time.time()}))
    await client.hset(keys.workers, "gone", msgpack.packb({"time": time.time() - 600}))
    snapshot = await StreamStats(client, keys).refresh()
    await client.aclose()
    assert (snapshot.depth[Lane.BATCH], snapshot.pending[Lane.BATCH], snapshot.unheld[Lane.BATCH]) == (5, 4, 3)
    assert snapshot.unheld[Lane.STANDARD] == 0
