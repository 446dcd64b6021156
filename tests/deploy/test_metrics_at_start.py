"""A process that has just started already exports, at 0, every counter series whose labels are known in
advance, so `rate()`, `increase()` and alerts on them see the series before its first event."""

from __future__ import annotations

from scheduler.protocol.lanes import LANES
from tests.harness.telemetry_support import samples

# Every reason a worker dead-letters a lane entry for (docs/observability.md, the `dead_letter` log field).
DEAD_LETTER_REASONS = ("no_job_field", "invalid_job", "too_many_deliveries", "duplicate_entry", "unadmittable")


def fresh_worker_metrics() -> str:
    """What a worker that has done nothing yet exports."""
    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    try:
        return metrics.render().decode()
    finally:
        metrics.close()


def test_worker_exports_every_dead_letter_reason_at_zero() -> None:
    text = fresh_worker_metrics()
    exported = {dict(labels)["carpool_dead_letter_reason"]: v for (name, labels), v in samples(text).items()
                if name == "carpool_jobs_dead_lettered_total" and ("carpool_lane", LANES[0].value) in labels}
    assert exported == dict.fromkeys(DEAD_LETTER_REASONS, 0.0)
    series = [labels for name, labels in samples(text) if name == "carpool_jobs_dead_lettered_total"]
    assert len(series) == len(LANES) * len(DEAD_LETTER_REASONS)


def test_worker_exports_every_lane_and_ending_of_finished_jobs_at_zero() -> None:
    """So `increase(carpool_jobs_finished_total{carpool_job_status="failed"}[5m])` sees the first failure."""
    text = fresh_worker_metrics()
    exported = {(dict(labels)["carpool_lane"], dict(labels)["carpool_job_status"]): v
                for (name, labels), v in samples(text).items() if name == "carpool_jobs_finished_total"}
    assert exported == {(lane.value, status): 0.0 for lane in LANES
                        for status in ("succeeded", "failed", "cancelled", "expired")}


def test_worker_exports_its_idle_engines_gauges_at_zero() -> None:
    """Before its engine's first step (an idle worker, its engine in a process of its own, has not ticked), the
    engine gauges read as an engine that has run nothing, not as absent, which `absent()` takes for a worker gone."""
    text = fresh_worker_metrics()
    exported = {name: v for (name, labels), v in samples(text).items() if name.startswith("carpool_engine_")}
    assert {"carpool_engine_sequences_running", "carpool_engine_sequences_waiting", "carpool_engine_batch_occupancy",
            "carpool_engine_preemptions_total"} <= set(exported), sorted(exported)
    assert set(exported.values()) == {0.0}, exported


def test_a_dispatcher_exports_every_event_and_outcome_of_its_deliveries_at_zero() -> None:
    """Jobs' events and Batch API batches' alike, so an alert on `batch.failed` deliveries gone dead sees the series
    before the first."""
    from gateway.webhooks.metrics import WEBHOOK_OUTCOMES, WebhookMetrics
    from scheduler.protocol.job import WebhookEvent
    from scheduler.protocol.webhooks import BatchEvent
    from tests.harness.telemetry_support import in_memory_telemetry

    telemetry, _ = in_memory_telemetry("carpool-webhooks")
    try:
        WebhookMetrics(telemetry)
        text = telemetry.render_metrics().decode()
    finally:
        telemetry.shutdown()
    exported = {(dict(labels)["carpool_webhook_event"], dict(labels)["carpool_webhook_outcome"]): v
                for (name, labels), v in samples(text).items() if name == "carpool_webhook_deliveries_total"}
    events = [event.value for event in (*WebhookEvent, *BatchEvent)]
    assert exported == {(event, outcome): 0.0 for event in events for outcome in WEBHOOK_OUTCOMES}
    assert ("batch.failed", "dead") in exported
