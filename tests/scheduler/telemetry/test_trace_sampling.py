"""OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG choose which traces are recorded, as the OpenTelemetry SDKs read
them; a value carpool does not take is refused at start-up, as an unknown exporter is."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from scheduler.telemetry.otel import Telemetry, telemetry_config_from_env

SAMPLED_PARENT = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
    trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331, is_remote=True,
    trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))))


def _recorded(env: dict[str, str]) -> tuple[int, int]:
    """Spans recorded of 20 root spans, and of 20 spans under a sampled remote parent."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(telemetry_config_from_env(env, service_name="s"),
                          span_processors=[SimpleSpanProcessor(exporter)])
    try:
        for _ in range(20):
            with telemetry.tracer.start_as_current_span("root"):
                pass
        roots = len(exporter.get_finished_spans())
        for _ in range(20):
            with telemetry.tracer.start_as_current_span("child", context=SAMPLED_PARENT):
                pass
        return roots, len(exporter.get_finished_spans()) - roots
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize(("env", "recorded"), [
    ({}, (20, 20)),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, (0, 0)),
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, (0, 20)),  # the caller's decision is followed
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, (0, 0)),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, (0, 20)),
    ({"OTEL_TRACES_SAMPLER": "PARENTBASED_TRACEIDRATIO", "OTEL_TRACES_SAMPLER_ARG": "1"}, (20, 20)),
])
def test_the_sampler_the_environment_names_decides_what_is_recorded(env: dict[str, str],
                                                                    recorded: tuple[int, int]) -> None:
    assert _recorded(env) == recorded


@pytest.mark.parametrize(("env", "refusal"), [
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER: expected one of parentbased_always_on"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG: expected"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG: expected"),
])
def test_a_sampler_or_share_carpool_cannot_take_is_refused(env: dict[str, str], refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        telemetry_config_from_env(env, service_name="s")
