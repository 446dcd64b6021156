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
                             otlp_metrics_endpoint=f"{silent_collector}/v1/metrics", otlp_timeout_s=0.5)
    telemetry = Telemetry(config)
    telemetry.meter.create_counter("carpool_test_total").add(1, {A_LANE: "batch"})
    with telemetry.tracer.start_as_current_span("job"):
        pass
    started = time.monotonic()
    telemetry.shutdown()
    # Two signals of 0.5 s each, and the exporters' own retry pauses; the library's defaults alone took 20 s.
    assert time.monotonic() - started < 5


def test_the_export_timeout_is_read_in_milliseconds_and_refused_when_not_a_number() -> None:
    assert telemetry_config_from_env({}, service_name="s").otlp_timeout_s == 5.0
    assert telemetry_config_from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}, service_name="s").otlp_timeout_s == 2.5
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TIMEOUT|otlp_timeout_s"):
            telemetry_config_from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": bad}, service_name="s")
