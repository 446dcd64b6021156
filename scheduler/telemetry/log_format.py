"""Structured logs: one JSON object per line, carrying the job id and trace id of the job it is about.

The job a piece of code works on is held in a ``ContextVar`` (per asyncio task
and per thread, so concurrent jobs never see each other's id); ``job_context``
sets it for a block. The trace id comes from the current OpenTelemetry span.
``configure_logging`` is called once by a process's CLI, never at import.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import trace

# Per-context state, not shared mutable state: each task and thread sees its own value.
_JOB_ID: ContextVar[str | None] = ContextVar("carpool_job_id", default=None)

# Attributes every LogRecord has; anything else was passed through ``extra=`` and is logged as a field.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}


@contextmanager
def job_context(job_id: str, span: trace.Span | None = None) -> Iterator[None]:
    """Every log record emitted inside the block (this task or thread) names ``job_id``.

    With ``span``, that span is also made current, so the records carry its trace id.
    """
    token = _JOB_ID.set(job_id)
    span_token = otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
    try:
        yield
    finally:
        if span_token is not None:
            otel_context.detach(span_token)
        _JOB_ID.reset(token)


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "job_id", "trace_id", "span_id", ...extra, "exc"}``."""

    def __init__(self, *, service: str | None = None) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.service:
            out["service"] = self.service
        job_id = getattr(record, "job_id", None) or _JOB_ID.get()
        if job_id:
            out["job_id"] = job_id
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            out["trace_id"] = format(span_context.trace_id, "032x")
            out["span_id"] = format(span_context.span_id, "016x")
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in out:
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The lines of ``configure_logging(is_json=False)``."""


def check_log_level(level: str) -> str:
    """``level`` as ``configure_logging`` takes it (``info`` -> ``INFO``); ``ValueError`` naming the choices."""
    name = level.strip().upper()
    if name not in logging.getLevelNamesMapping():
        raise ValueError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return name


TELEMETRY_LOG_EVERY_S = 30.0
"""How often the same warning or error of OpenTelemetry's own (a collector that does not answer) is said."""


class TelemetryLogThrottle(logging.Filter):
    """A handler's filter: a record of OpenTelemetry's own loggers (``opentelemetry.*``: an exporter whose
    collector does not answer says so at every export, forever) passes once per `every_s` for each logger and
    message, the next one that passes saying how many were left out; every other record passes as it is."""

    def __init__(self, every_s: float = TELEMETRY_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._every_s = every_s
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._left_out: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("opentelemetry."):
            return True
        key, now = (record.name, str(record.msg)), self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._every_s:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return False
        self._last[key] = now
        if left_out := self._left_out.pop(key, 0):
            record.msg, record.args = f"{record.getMessage()} ({left_out} more such since the last of these)", None
        return True


def configure_logging(
    level: str | int = "INFO", *, stream: IO[str] | None = None, service: str | None = None, is_json: bool = True
) -> logging.Handler:
    """Route the root logger to one handler on ``stream`` (default stderr), JSON lines unless ``is_json`` is false;
    OpenTelemetry's own repeated warnings are said once in a while (`TelemetryLogThrottle`)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter(service=service) if is_json else logging.Formatter(PLAIN_FORMAT)
    )
    handler.addFilter(TelemetryLogThrottle())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


@dataclass(frozen=True)
class LogSettings:
    """How a process logs (what `configure_logging` takes), for a child process to log the same way."""

    level: str | int
    service: str | None
    is_json: bool = True

