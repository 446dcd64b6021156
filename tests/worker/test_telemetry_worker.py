"""Worker telemetry around the engine: dead-lettered jobs are finished jobs too, and every log line about
a job (reclaim, admission, dead-letter, commit) names the job and its trace as JSON fields."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec, JobStatus
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import LANES, Lane
from tests.harness.telemetry_support import json_logs, value
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, wait_until, xadd_job


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


async def crashed_worker_holds(client: aioredis.Redis, spec: JobSpec) -> None:
    """Put a job on its lane as read by a worker that then died: pending, never renewed."""
    for lane in LANES:
        await client.xgroup_create(KEYS.lane(lane), CONSUMER_GROUP, id="0", mkstream=True)
    await xadd_job(client, spec)
    read = await client.xreadgroup(CONSUMER_GROUP, "crashed-worker", {KEYS.lane(spec.lane): ">"}, count=1)
    assert len(read[0][1]) == 1


def finished_count(worker: Any) -> float:
    return value(worker.metrics.render().decode(), "carpool_jobs_finished_total")


async def num_dead_at_least(client: aioredis.Redis, count: int) -> bool:
    return await client.xlen(KEYS.dead) >= count


async def test_dead_lettered_jobs_count_as_failed_jobs(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    # Delivered once to the crashed worker; the reclaim is its second delivery, past max_deliveries=1.
    await crashed_worker_holds(client, JobSpec(id="redelivered", prompt="too often", params=params))
    async with running_worker(redis_url, engine, max_deliveries=1, lease_s=0.3) as worker:
        await client.xadd(KEYS.lane(Lane.BATCH), {"job": msgpack.packb(
            {"v": 1, "id": "poison", "prompt": "hi", "params": {"temperature": -1}})})
        await xadd_job(client, JobSpec(id="good", prompt="fine", params=params))
        views = await wait_terminal(client, ["redelivered", "poison", "good"])
        await wait_until(lambda: num_dead_at_least(client, 2), "2 dead-lettered entries")
        # A job is counted just after its record ends: wait for the three counts, not for the records alone.
        await wait_until(lambda: finished_count(worker) >= 3, "3 finished jobs counted")
        text = worker.metrics.render().decode()
    await client.aclose()
    assert {job_id: v["status"] for job_id, v in views.items()} == {
        "redelivered": "failed", "poison": "failed", "good": "succeeded"}
    assert views["redelivered"]["error"]["type"] == "too_many_deliveries"
    # It never had a record: the failed one still says where and since when it waited.
    assert views["redelivered"]["lane"] == "standard" and views["redelivered"]["created_at"] > 0
    assert value(text, "carpool_jobs_dead_lettered_total", carpool_dead_letter_reason="too_many_deliveries",
                 carpool_lane="standard") == 1
    assert value(text, "carpool_jobs_dead_lettered_total", carpool_dead_letter_reason="invalid_job",
                 carpool_lane="batch") == 1
    # both dead-lettered jobs are finished jobs, on their own lane, with an end-to-end latency
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="failed") == 2
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="failed", carpool_lane="standard") == 1
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="failed", carpool_lane="batch") == 1
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="succeeded") == 1
    assert value(text, "gen_ai_server_request_duration_seconds_count", carpool_job_status="failed") == 2


@contextmanager
def worker_json_logs() -> Iterator[io.StringIO]:
    """The JSON lines the worker's loggers write while the block runs."""
    with json_logs("worker", "carpool-worker") as stream:
        yield stream


GOOD_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
POISON_TRACE = "0af7651916cd43dd8448eb211c80319c"


async def test_log_lines_about_a_job_carry_its_id_and_trace(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    good = JobSpec(id="good", prompt="taken over", params=SamplingParams(max_tokens=2, temperature=0.0),
                   traceparent=f"00-{GOOD_TRACE}-00f067aa0ba902b7-01")
    await crashed_worker_holds(client, good)
    with worker_json_logs() as stream:
        async with running_worker(redis_url, engine, lease_s=0.3):
            await client.xadd(KEYS.lane(Lane.BATCH), {"job": msgpack.packb(
                {"v": 1, "id": "poison", "prompt": "hi", "params": {"temperature": -1},
                 "traceparent": f"00-{POISON_TRACE}-b7ad6b7169203331-01"})})
            views = await wait_terminal(client, ["good", "poison"])
            await wait_until(lambda: "good: succeeded" in stream.getvalue(), "the log line of good's success")
    await client.aclose()
    assert views["good"]["status"] == "succeeded" and views["poison"]["status"] == "failed"
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    about = {job_id: [r for r in records if f"job {job_id}:" in r["message"]] for job_id in ("good", "poison")}
    good_lines: dict[str, dict[str, Any]] = {}
    for r in about["good"]:  # the first line of each kind: a loaded machine may reclaim the entry again later
        good_lines.setdefault(r["message"].split(":")[1].split()[0], r)
    assert {"reclaimed", "admitted", "succeeded"} <= set(good_lines), [r["message"] for r in about["good"]]
    assert good_lines["reclaimed"]["delivery"] == 2 and good_lines["admitted"]["lane"] == "standard"
    (poison_line,) = about["poison"]
    assert "dead-lettered" in poison_line["message"] and poison_line["dead_letter"] == "invalid_job"
    for job_id, trace_id in (("good", GOOD_TRACE), ("poison", POISON_TRACE)):
        for record in about[job_id]:
            assert record["job_id"] == job_id and record["trace_id"] == trace_id, record
            assert record["service"] == "carpool-worker"
    # the one line not about a job names none
    (ready,) = [r for r in records if "ready" in r["message"]]
    assert "job_id" not in ready and "trace_id" not in ready


@pytest.mark.parametrize("traceparent", [None, "garbage", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
def test_a_jobs_wait_and_run_share_one_trace_with_or_without_a_producers_context(traceparent: str | None) -> None:
    """A job XADDed without a (valid) traceparent starts its trace at the worker: its queue wait joins it under
    the job's span, rather than starting a second trace. With one, both are children of the producer's span."""
    from tests.harness.telemetry_support import in_memory_telemetry
    from worker.metrics import WorkerMetrics

    telemetry, spans = in_memory_telemetry("carpool-worker")
    metrics = WorkerMetrics(telemetry)
    job = metrics.job_started(JobSpec(id="t1", prompt="x", traceparent=traceparent), created_s=100.0, now_s=101.0)
    job.span.end()
    by_name = {span.name: span for span in spans.get_finished_spans()}
    wait, run = by_name["carpool.queue_wait"], by_name["carpool.job"]
    assert wait.context.trace_id == run.context.trace_id and wait.parent is not None
    if traceparent is None or traceparent == "garbage":
        assert run.parent is None and wait.parent.span_id == run.context.span_id
    else:
        assert run.parent is not None and f"{run.context.trace_id:032x}" == traceparent.split("-")[1]
        assert wait.parent.span_id == run.parent.span_id == int(traceparent.split("-")[2], 16)
    metrics.close()
    telemetry.shutdown()


async def test_a_job_cancelled_while_queued_leaves_its_lane_and_counts_once_as_finished(
        gateway_url: str, redis_url: str, engine) -> None:
    """The gateway decides it: its entry leaves the lane at once, and the gateway counts it among the finished
    jobs. A second entry of the same id, a producer's repeat, is only acknowledged by the worker that meets it,
    and counted by nobody."""
    from aiohttp import ClientSession

    client = aioredis.Redis.from_url(redis_url)
    async with ClientSession() as http:
        async with http.post(f"{gateway_url}/v1/jobs", json={"id": "never-ran", "prompt": "x"}) as resp:
            assert resp.status == 202
        async with http.delete(f"{gateway_url}/v1/jobs/never-ran") as resp:
            assert resp.status == 202
        assert await client.xlen(KEYS.lane(Lane.STANDARD)) == 0
        async with http.get(f"{gateway_url}/metrics") as resp:
            gateway_text = await resp.text()
    assert value(gateway_text, "carpool_jobs_finished_total", carpool_job_status="cancelled",
                 carpool_lane="standard") == 1
    assert value(gateway_text, "carpool_tenant_jobs_total", carpool_tenant="default",
                 carpool_job_status="cancelled") == 1
    await xadd_job(client, JobSpec(id="never-ran", prompt="x"))  # a repeat of the id, after the cancel

    async def repeat_taken() -> bool:
        return await client.xlen(KEYS.lane(Lane.STANDARD)) == 0 and not worker.intake.admitting

    async with running_worker(redis_url, engine) as worker:
        await wait_until(repeat_taken, "the repeated entry taken")
        text = worker.metrics.render().decode()
        assert (await client.hget(KEYS.job("never-ran"), "status")) == b"cancelled"
    await client.aclose()
    assert value(text, "carpool_jobs_finished_total") == 0


async def test_entries_dead_lettered_before_any_job_is_read_each_get_a_line(redis_url: str, engine) -> None:
    """No `job` field, or one that names no readable id: a warning each, naming the entry and its lane."""
    client = aioredis.Redis.from_url(redis_url)
    with worker_json_logs() as stream:
        async with running_worker(redis_url, engine):
            await client.xadd(KEYS.lane(Lane.BATCH), {"foo": "bar"})
            await client.xadd(KEYS.lane(Lane.BATCH), {"job": b"\xc1 not msgpack"})
            await wait_until(lambda: num_dead_at_least(client, 2), "2 dead-lettered entries")
    await client.aclose()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    dead = sorted((r["dead_letter"], r["lane"], r["level"]) for r in lines if "dead_letter" in r)
    assert dead == [("invalid_job", "batch", "warning"), ("no_job_field", "batch", "warning")], lines


async def test_the_line_of_a_cancel_while_running_names_the_job_and_its_trace(redis_url: str, tiny_model) -> None:
    from worker.engine.engine import Engine

    engine = Engine(model=tiny_model(max_position_embeddings=16384), max_num_seqs=2)
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=16000, temperature=0, ignore_eos=True)
    with worker_json_logs() as stream:
        async with running_worker(redis_url, engine):
            await xadd_job(client, JobSpec(id="stopped", prompt="x", params=params,
                                           traceparent=f"00-{GOOD_TRACE}-b7ad6b7169203331-01"))
            await wait_until(lambda: client.hget(KEYS.job("stopped"), "first_token_at"), "the first token")
            await client.set(KEYS.cancel("stopped"), 1)  # as the gateway flags a cancel, seen at a checkpoint
            await wait_terminal(client, ["stopped"])
    await client.aclose()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    (cancelled,) = [r for r in lines if "cancelled while running" in r["message"]]
    assert cancelled["job_id"] == "stopped" and cancelled["trace_id"] == GOOD_TRACE, cancelled


async def test_a_direct_xadd_moved_into_its_tenants_stream_waits_from_its_first_xadd(redis_url: str, engine) -> None:
    """A producer's entry naming a tenant is moved into that tenant's stream under a new id; its queue wait still
    runs from the producer's XADD, as its record's ``created_at`` does."""
    client = aioredis.Redis.from_url(redis_url)
    first_xadd_ms = int((await client.time())[0]) * 1000 - 120_000  # as if it had waited two minutes
    await client.xadd(KEYS.lane(Lane.STANDARD), {"job": msgpack.packb({"v": 1, "id": "routed", "prompt": "hi",
                                                                       "tenant": "acme"})},
                      id=f"{first_xadd_ms}-0")
    async with running_worker(redis_url, engine) as worker:
        views = await wait_terminal(client, ["routed"])
        rendered = worker.metrics.render().decode()
    await client.aclose()
    assert views["routed"]["status"] == "succeeded"
    assert value(rendered, "carpool_job_queue_wait_seconds_sum") >= 119
    assert value(rendered, "carpool_tenant_queue_wait_seconds_sum", carpool_tenant="acme") >= 119


async def test_the_workers_probes_and_scrapes_write_no_access_lines(redis_url: str, engine, caplog) -> None:
    """A worker's metrics server serves only probes and scrapes, every few seconds each: none of them is logged
    (the gateway logs its own at debug)."""
    import logging

    import aiohttp

    from gateway.cli.embedded_redis import free_port

    port = free_port()
    async with running_worker(redis_url, engine, metrics_port=port, metrics_host="127.0.0.1"):
        with caplog.at_level(logging.DEBUG, logger="aiohttp.access"):
            async with aiohttp.ClientSession() as http:
                for path in ("/healthz", "/readyz", "/metrics"):
                    async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
                        assert resp.status == 200, (path, resp.status)
    assert not [r for r in caplog.records if r.name == "aiohttp.access"], caplog.text


def test_a_job_stopped_before_its_engine_took_a_step_of_it_records_no_token_usage() -> None:
    """Cancelled right after admission (its prompt not yet prefilled): counted as finished, but no 0-token usage
    sample drags the token histograms' quantiles down; one that ran records its tokens."""
    from tests.harness.telemetry_support import in_memory_telemetry
    from worker.metrics import WorkerMetrics

    telemetry, _ = in_memory_telemetry("carpool-worker")
    metrics = WorkerMetrics(telemetry)
    for job_id, prompt_tokens, completion_tokens in (("early", 0, 0), ("ran", 12, 3)):
        job = metrics.job_started(JobSpec(id=job_id, prompt="x"), created_s=100.0, now_s=101.0)
        metrics.job_finished(job, JobStatus.CANCELLED, prompt_tokens=prompt_tokens,
                             completion_tokens=completion_tokens, first_token_s=None, now_s=102.0)
    text = metrics.render().decode()
    metrics.close()
    telemetry.shutdown()
    assert value(text, "carpool_jobs_finished_total", carpool_job_status="cancelled", carpool_lane="standard") == 2
    assert value(text, "gen_ai_client_token_usage_count", gen_ai_token_type="input") == 1
    assert value(text, "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == 12
