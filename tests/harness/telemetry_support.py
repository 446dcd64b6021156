"""Helpers for the telemetry tests: read Prometheus text and span trees the way a scraper would."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from scheduler.telemetry.log_format import JsonFormatter
from scheduler.telemetry.otel import Telemetry, TelemetryConfig


def in_memory_telemetry(service_name: str) -> tuple[Telemetry, InMemorySpanExporter]:
    """A Telemetry whose spans land in memory; one per modelled process."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetryConfig(service_name=service_name), span_processors=[SimpleSpanProcessor(exporter)])
    return telemetry, exporter


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value for every sample in a Prometheus text exposition."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and wanted <= ls)


def sample_names(text: str) -> set[str]:
    return {name for name, _ in samples(text)}


def spans_by_trace(spans: Iterable[ReadableSpan]) -> dict[int, list[ReadableSpan]]:
    out: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.context.trace_id, []).append(span)
    return out


def is_connected(spans: Sequence[ReadableSpan], remote_parent_span_id: int | None = None) -> bool:
    """Every span's parent is another span of the list, except one root (or children of the given remote parent)."""
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    if remote_parent_span_id is not None:
        return all(s.parent is not None and s.parent.span_id == remote_parent_span_id for s in roots)
    return len(roots) == 1 and roots[0].parent is None


@contextmanager
def json_logs(logger_name: str, service: str) -> Iterator[io.StringIO]:
    """The JSON lines (at info and above) that `logger_name`'s loggers write while the block runs."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(service=service))
    logger = logging.getLogger(logger_name)
    saved_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
