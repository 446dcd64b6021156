"""Telemetry shared by the gateway and the worker: the metric schema, the SDK set-up, trace propagation.

The one place in ``scheduler`` that imports something besides stdlib and
msgpack: the OpenTelemetry API and SDK (never torch). Every metric either
process exports is declared here as data (``MetricSpec``), so documentation,
the Grafana dashboard test and the instruments all read the same list.

A ``Telemetry`` object owns one MeterProvider and one TracerProvider and
never installs them globally: two of them in one process (a test modelling the
gateway and the worker) do not see each other's data. Metrics go to a
Prometheus reader on a private ``CollectorRegistry`` (rendered by ``/metrics``)
and, when an OTLP endpoint is configured, to an OTLP/HTTP exporter as well; spans go to OTLP/HTTP and,
with ``OTEL_TRACES_EXPORTER=console``, as one JSON line each to stdout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import unquote

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, generate_latest

from scheduler.telemetry.metric_schema import MetricSpec

INSTRUMENTATION_SCOPE = "carpool"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


MAX_OTLP_TIMEOUT_S = 600.0
DEFAULT_OTLP_TIMEOUT_S = 5.0


class OtlpProtocol(str, Enum):
    HTTP_PROTOBUF = "http/protobuf"


@dataclass
class TelemetryConfig:
    """What one process exports. Built once at start-up (see ``telemetry_config_from_env``)."""

    service_name: str
    service_instance_id: str | None = None
    resource_attributes: dict[str, str] = field(default_factory=dict)
    otlp_traces_endpoint: str | None = None  # full URL, e.g. http://collector:4318/v1/traces
    otlp_metrics_endpoint: str | None = None  # full URL, e.g. http://collector:4318/v1/metrics
    otlp_headers: dict[str, str] = field(default_factory=dict)
    metric_export_interval_ms: int = 15_000
    is_console_traces: bool = False  # one JSON line per finished span on stdout
    is_console_metrics: bool = False  # one JSON line per metric export on stdout, every export interval
    otlp_traces_timeout_s: float = DEFAULT_OTLP_TIMEOUT_S
    """How long one OTLP export of spans may take, its retries included; a process's exit waits at most this long
    for its last one, so a collector that stopped answering delays a shutdown by at most the two timeouts."""
    otlp_metrics_timeout_s: float = DEFAULT_OTLP_TIMEOUT_S
    traces_sampler: str = "parentbased_always_on"
    """Which traces are recorded (``OTEL_TRACES_SAMPLER``, one of `TRACES_SAMPLERS`)."""
    traces_sampler_ratio: float = 1.0
    """The share of traces a ``traceidratio`` sampler records (``OTEL_TRACES_SAMPLER_ARG``)."""

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("service_name: must be non-empty")
        if self.traces_sampler not in TRACES_SAMPLERS:
            raise ValueError(f"traces_sampler: expected one of {', '.join(TRACES_SAMPLERS)}, got "
                             f"{self.traces_sampler!r}")
        if not 0 <= self.traces_sampler_ratio <= 1:
            raise ValueError(f"traces_sampler_ratio: must be in [0, 1], got {self.traces_sampler_ratio}")
        for name in ("otlp_traces_timeout_s", "otlp_metrics_timeout_s"):
            if not 0 < getattr(self, name) <= MAX_OTLP_TIMEOUT_S:
                raise ValueError(f"{name}: must be in (0, {MAX_OTLP_TIMEOUT_S:g}] seconds, got {getattr(self, name)}")
        if self.metric_export_interval_ms < 100:
            raise ValueError(f"metric_export_interval_ms: must be at least 100, got {self.metric_export_interval_ms}")
        for name in ("otlp_traces_endpoint", "otlp_metrics_endpoint"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{name}: expected an http:// or https:// URL, got {url!r}")

    def sampler(self) -> Sampler:
        """The sampler `traces_sampler` names: a root one, or one that follows the parent's decision where a span
        has a parent (an incoming ``traceparent``, the gateway's span for the job it enqueued) and asks the root
        one otherwise."""
        name = self.traces_sampler.removeprefix("parentbased_")
        root = ALWAYS_ON if name == "always_on" else ALWAYS_OFF if name == "always_off" else TraceIdRatioBased(
            self.traces_sampler_ratio)
        return ParentBased(root) if self.traces_sampler.startswith("parentbased_") else root


def _parse_key_values(text: str, variable: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (values URL-encoded) as the OTel spec writes headers and resource attributes."""
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{variable}: expected key=value pairs separated by commas, got {part!r}")
        out[unquote(key.strip())] = unquote(value.strip())
    return out


TRACES_SAMPLERS = ("parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio", "always_on",
                   "always_off", "traceidratio")
"""The values of ``OTEL_TRACES_SAMPLER`` carpool takes, as the OpenTelemetry SDKs name them."""
TRACES_EXPORTERS = ("otlp", "console", "none")
METRICS_EXPORTERS = ("otlp", "console", "prometheus", "none")
"""The values of ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` carpool acts on (``/metrics`` is always
served, so ``prometheus`` adds nothing to it); a comma-separated list names several."""


def _exporters(env: Mapping[str, str], variable: str, known: tuple[str, ...]) -> set[str]:
    text = env.get(variable, "")
    names = {part.strip().lower() for part in text.split(",") if part.strip()} or {"otlp"}
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(f"{variable}: expected some of {', '.join(known)}, got {text!r}")
    return names


def _timeout_s(env: Mapping[str, str], signal_variable: str) -> float:
    """A signal's OTLP export timeout: its own variable, else ``OTEL_EXPORTER_OTLP_TIMEOUT``, in seconds as
    OpenTelemetry's Python exporters read them (an empty one is unset); default 5."""
    for variable in (signal_variable, "OTEL_EXPORTER_OTLP_TIMEOUT"):
        if raw := env.get(variable, "").strip():
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not 0 < value <= MAX_OTLP_TIMEOUT_S:
                raise ValueError(f"{variable}: expected seconds in (0, {MAX_OTLP_TIMEOUT_S:g}] (as OpenTelemetry's "
                                 f"Python exporters read it), got {raw!r}")
            return value
    return DEFAULT_OTLP_TIMEOUT_S


def telemetry_config_from_env(
    env: Mapping[str, str], *, service_name: str, service_instance_id: str | None = None
) -> TelemetryConfig:
    """Read the standard ``OTEL_*`` variables once, at the edge.

    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL (``/v1/traces`` and
    ``/v1/metrics`` are appended); the per-signal ``..._TRACES_ENDPOINT`` /
    ``..._METRICS_ENDPOINT`` are used as given; ``OTEL_TRACES_EXPORTER`` /
    ``OTEL_METRICS_EXPORTER`` name a signal's exporters (``otlp``, the default, when an endpoint is set;
    ``console``; ``none``); any other value is a ``ValueError``.
    """
    protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", OtlpProtocol.HTTP_PROTOBUF.value)
    if protocol != OtlpProtocol.HTTP_PROTOBUF.value:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is supported, got {protocol!r}")
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").rstrip("/")
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or (f"{base}/v1/traces" if base else None)
    metrics = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or (f"{base}/v1/metrics" if base else None)
    traces_exporters = _exporters(env, "OTEL_TRACES_EXPORTER", TRACES_EXPORTERS)
    metrics_exporters = _exporters(env, "OTEL_METRICS_EXPORTER", METRICS_EXPORTERS)
    if "otlp" not in traces_exporters:
        traces = None
    if "otlp" not in metrics_exporters:
        metrics = None
    headers = _parse_key_values(env.get("OTEL_EXPORTER_OTLP_HEADERS", ""), "OTEL_EXPORTER_OTLP_HEADERS")
    attributes = _parse_key_values(env.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
    interval = env.get("OTEL_METRIC_EXPORT_INTERVAL", "15000")
    try:
        interval_ms = int(interval)
    except ValueError as e:
        raise ValueError(f"OTEL_METRIC_EXPORT_INTERVAL: expected milliseconds, got {interval!r}") from e
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if sampler not in TRACES_SAMPLERS:
        raise ValueError(f"OTEL_TRACES_SAMPLER: expected one of {', '.join(TRACES_SAMPLERS)}, got "
                         f"{env['OTEL_TRACES_SAMPLER']!r}")
    ratio = 1.0
    if sampler.endswith("traceidratio") and (raw_ratio := env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()):
        try:
            ratio = float(raw_ratio)
        except ValueError:
            ratio = math.nan
        if not 0 <= ratio <= 1:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG: expected a share of traces in [0, 1], got {raw_ratio!r}")
    traces_timeout_s = _timeout_s(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
    metrics_timeout_s = _timeout_s(env, "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT")
    return TelemetryConfig(
        service_name=env.get("OTEL_SERVICE_NAME") or service_name,
        service_instance_id=service_instance_id,
        resource_attributes=attributes,
        otlp_traces_endpoint=traces,
        otlp_metrics_endpoint=metrics,
        otlp_headers=headers,
        metric_export_interval_ms=interval_ms,
        otlp_traces_timeout_s=traces_timeout_s,
        otlp_metrics_timeout_s=metrics_timeout_s,
        is_console_traces="console" in traces_exporters,
        is_console_metrics="console" in metrics_exporters,
        traces_sampler=sampler,
        traces_sampler_ratio=ratio,
    )


class Telemetry:
    """One process's meter and tracer, their exporters, and its Prometheus text.

    ``span_processors`` and ``metric_readers`` add to what the config asks for;
    tests pass a ``SimpleSpanProcessor(InMemorySpanExporter())`` here.
    """

    def __init__(
        self,
        config: TelemetryConfig,
        *,
        span_processors: Sequence[SpanProcessor] = (),
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        self.config = config
        attributes: dict[str, str] = {**config.resource_attributes, "service.name": config.service_name}
        if config.service_instance_id:
            attributes["service.instance.id"] = config.service_instance_id
        # Resource(...) rather than Resource.create(...): the latter reads OTEL_* from os.environ itself.
        self.resource = Resource(attributes)
        self.registry = CollectorRegistry(auto_describe=False)
        readers: list[MetricReader] = [
            PrometheusMetricReader(scope_info_enabled=False, registry=self.registry),
            *metric_readers,
        ]
        if config.otlp_metrics_endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            metric_exporter = OTLPMetricExporter(endpoint=config.otlp_metrics_endpoint, headers=config.otlp_headers,
                                                 timeout=config.otlp_metrics_timeout_s)
            readers.append(
                PeriodicExportingMetricReader(metric_exporter, export_interval_millis=config.metric_export_interval_ms)
            )
        if config.is_console_metrics:
            console_metrics = ConsoleMetricExporter(formatter=lambda data: data.to_json(indent=None) + "\n")
            readers.append(
                PeriodicExportingMetricReader(console_metrics, export_interval_millis=config.metric_export_interval_ms)
            )
        self.meter_provider = MeterProvider(metric_readers=readers, resource=self.resource, shutdown_on_exit=False)
        self.meter = self.meter_provider.get_meter(INSTRUMENTATION_SCOPE)
        self.tracer_provider = TracerProvider(
            resource=self.resource, sampler=config.sampler(), shutdown_on_exit=False
        )
        if config.otlp_traces_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(endpoint=config.otlp_traces_endpoint, headers=config.otlp_headers,
                                             timeout=config.otlp_traces_timeout_s)
            self.tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        if config.is_console_traces:
            console_spans = ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")
            self.tracer_provider.add_span_processor(BatchSpanProcessor(console_spans))
        for processor in span_processors:
            self.tracer_provider.add_span_processor(processor)
        self.tracer = self.tracer_provider.get_tracer(INSTRUMENTATION_SCOPE)
        self._is_shut_down = False

    def counter(self, spec: MetricSpec) -> Any:
        spec.check_kind("counter")
        return self.meter.create_counter(spec.name, unit=spec.unit, description=spec.description)

    def up_down_counter(self, spec: MetricSpec) -> Any:
        spec.check_kind("up_down_counter")
        return self.meter.create_up_down_counter(spec.name, unit=spec.unit, description=spec.description)

    def histogram(self, spec: MetricSpec) -> Any:
        spec.check_kind("histogram")
        return self.meter.create_histogram(
            spec.name,
            unit=spec.unit,
            description=spec.description,
            explicit_bucket_boundaries_advisory=list(spec.buckets) if spec.buckets else None,
        )

    def observable(self, spec: MetricSpec, callback: Any) -> Any:
        """An observable gauge or counter; ``callback(options) -> Iterable[Observation]`` must not block."""
        if spec.kind == "observable_gauge":
            return self.meter.create_observable_gauge(
                spec.name, callbacks=[callback], unit=spec.unit, description=spec.description
            )
        spec.check_kind("observable_counter")
        return self.meter.create_observable_counter(
            spec.name, callbacks=[callback], unit=spec.unit, description=spec.description
        )

    def render_metrics(self) -> bytes:
        """Prometheus text exposition of everything this process's meter holds (runs the gauge callbacks)."""
        return generate_latest(self.registry)

    def force_flush(self) -> None:
        self.tracer_provider.force_flush()
        self.meter_provider.force_flush()

    def shutdown(self) -> None:
        """Flush and stop the exporters; safe to call twice."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        # Each signal's last export is bounded by its exporter's timeout; the meter's shutdown also by its own,
        # which would otherwise wait 30 s.
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=self.config.otlp_metrics_timeout_s * 1000)


# W3C trace context ----------------------------------------------------------------

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless; holds no data between calls
TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def context_from_traceparent(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The remote parent a ``traceparent`` names, or ``None`` when it is absent or malformed."""
    if not traceparent or not TRACEPARENT_RE.match(traceparent.strip().lower()):
        return None
    carrier = {"traceparent": traceparent.strip().lower()}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _PROPAGATOR.extract(carrier)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def span_of_traceparent(traceparent: str | None) -> trace.Span | None:
    """The remote span a ``traceparent`` names (non-recording), to put a job's trace id on log lines."""
    ctx = context_from_traceparent(traceparent)
    return None if ctx is None else trace.get_current_span(ctx)


def traceparent_of(span: trace.Span | None = None) -> str | None:
    """The ``traceparent`` that makes a span (default: the current one) the parent of remote work."""
    ctx = trace.set_span_in_context(span) if span is not None else otel_context.get_current()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent")


def s_to_ns(t_s: float) -> int:
    """Unix seconds to the integer nanoseconds span timestamps take."""
    return int(t_s * 1e9)

