"""A process's exit waits for its last OTLP exports at most `otlp_timeout_s` a signal, even when the collector
took the connection and never answers (a hung collector, a black-holed network)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from scheduler.telemetry.metric_schema import A_LANE
from scheduler.telemetry.otel import Telemetry, TelemetryConfig, telemetry_config_from_env


@pytest.fixture
def silent_collector():
    """A TCP port that accepts connections, reads what is sent and answers nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_the_exit_waits_for_a_silent_collector_only_as_long_as_the_export_timeout(silent_collector) -> None:
    config = TelemetryConfig(service_name="carpool-test", otlp_traces_endpoint=f"{silent_collector}/v1/traces",
                             otlp_metrics_endpoint=f"{silent_collector}/v1/metrics", otlp_traces_timeout_s=0.5,
                             otlp_metrics_timeout_s=0.5)
    telemetry = Telemetry(config)
    telemetry.meter.create_counter("carpool_test_total").add(1, {A_LANE: "batch"})
    with telemetry.tracer.start_as_current_span("job"):
        pass
    started = time.monotonic()
    telemetry.shutdown()
    # Two signals of 0.5 s each, and the exporters' own retry pauses; the library's defaults alone took 20 s.
    assert time.monotonic() - started < 5


def test_the_export_timeouts_are_read_in_seconds_as_the_python_exporters_read_them() -> None:
    def timeouts(env: dict[str, str]) -> tuple[float, float]:
        config = telemetry_config_from_env(env, service_name="s")
        return config.otlp_traces_timeout_s, config.otlp_metrics_timeout_s

    assert timeouts({}) == timeouts({"OTEL_EXPORTER_OTLP_TIMEOUT": ""}) == (5.0, 5.0)  # empty: unset
    assert timeouts({"OTEL_EXPORTER_OTLP_TIMEOUT": "2.5"}) == (2.5, 2.5)
    assert timeouts({"OTEL_EXPORTER_OTLP_TIMEOUT": "10", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "3"}) == (10.0, 3.0)
    for bad in ("soon", "0", "-1", "nan", "100000"):
        with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_TIMEOUT: expected seconds"):
            telemetry_config_from_env({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": bad}, service_name="s")


@pytest.mark.parametrize(("env", "refusal"), [
    ({"OTEL_METRIC_EXPORT_INTERVAL": "5"}, "metric_export_interval_ms: must be at least 100, got 5"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "otlp_traces_endpoint: expected an http:// or https:// URL"),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "ftp://x"}, "otlp_metrics_endpoint: expected an http:// or https://"),
    ({"OTEL_TRACES_SAMPLER": "nope"}, "OTEL_TRACES_SAMPLER: expected one of"),
])
def test_settings_a_process_could_not_export_with_are_refused_at_start(env: dict[str, str], refusal: str) -> None:
    """An export every few milliseconds, or an endpoint that is no URL (which would fail at every export): refused
    when the process starts, naming the setting."""
    with pytest.raises(ValueError, match=refusal):
        telemetry_config_from_env(env, service_name="s")
