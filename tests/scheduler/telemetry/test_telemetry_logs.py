"""Structured logs: JSON lines naming the job and the trace of the work they are about."""

from __future__ import annotations

import asyncio
import io
import json
import logging

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
