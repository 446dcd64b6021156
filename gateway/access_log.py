"""The gateway's access log: one line per answered request, a JSON log line like every other.

aiohttp writes its access line after the request's middlewares have returned, outside the request's span
and job context, so what the line should name is noted on the request while it is handled (``note``): the
trace the request's span belongs to, the job (or jobs, file, batch) it is about. A job's id in the access
line finds every other line about that job, the worker's included; its ``trace_id`` finds the trace.

Probes and scrapes (``/healthz``, ``/readyz``, ``/metrics``) log at debug: every few seconds from every
prober, they would be most of the log.

A request aiohttp's own HTTP parser refuses (a header line too long, an encoding it cannot decode) is answered
400 before any route sees it, and aiohttp logs it as an error with a traceback: a client's fault, which any
client could repeat to fill the log. `log_parse_errors_as_client_errors` makes those one info line each.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError

# aiohttp 3.14 types a request's own keys (and warns of plain strings); older releases take a string.
_FIELDS: Any = web.RequestKey("log_fields", dict) if hasattr(web, "RequestKey") else "carpool.log_fields"

QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

CLIENT_CLOSED_REQUEST = 499
"""The status a request whose client went away is logged and counted with (no client reads it)."""
_CLIENT_GONE: Any = web.RequestKey("client_gone", bool) if hasattr(web, "RequestKey") else "carpool.client_gone"


def client_gone(request: web.BaseRequest) -> bool:
    """Whether the client closed its connection (the server does not cancel a handler when it does)."""
    return request.transport is None or request.transport.is_closing()


def note_client_gone(request: web.BaseRequest) -> None:
    """The client hung up while its answer was being sent (mid-stream): its status went out before, but the
    request is logged and counted with `CLIENT_CLOSED_REQUEST`, as one that hung up before its answer is."""
    request[_CLIENT_GONE] = True


def status_of(request: web.BaseRequest, response: web.StreamResponse) -> int:
    """The status a request is logged and counted with."""
    return CLIENT_CLOSED_REQUEST if request.get(_CLIENT_GONE) else response.status


# Which field a route's ``{id}`` is: the routes under /v1/jobs/ name a job, the others a file or a batch.
_ID_FIELDS = (("/v1/jobs/", "job_id"), ("/v1/files/", "file_id"), ("/v1/batches/", "batch_id"))


def note(request: web.BaseRequest, **fields: str) -> None:
    """Have the request's access line carry ``fields`` (a later note of the same field wins)."""
    found = request.get(_FIELDS)
    if found is None:
        found = request[_FIELDS] = {}
    found.update(fields)


def id_field(path: str) -> str | None:
    """The access-line field that a route's ``{id}`` fills, for a route path under /v1; None for others."""
    return next((field for prefix, field in _ID_FIELDS if path.startswith(prefix)), None)


def note_jobs(request: web.BaseRequest, job_ids: list[str]) -> None:
    """The jobs a request made: ``job_id`` when it made one, ``job_ids`` (comma-separated) when more."""
    if len(job_ids) == 1:
        note(request, job_id=job_ids[0])
    elif job_ids:
        note(request, job_ids=",".join(job_ids))


class AccessLogger(AbstractAccessLogger):
    """``POST /v1/jobs 202 12.3 ms``, with ``http_method``, ``http_path``, ``http_status``, ``duration_ms``,
    ``remote``, ``user_agent``, ``request_id`` and whatever was noted on the request as fields."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
        if not self.logger.isEnabledFor(level):
            return
        duration_ms = round(time * 1000, 1)
        fields: dict[str, Any] = {
            "http_method": request.method, "http_path": request.path, "http_status": status_of(request, response),
            "duration_ms": duration_ms, "remote": request.remote or "",
            "user_agent": request.headers.get("User-Agent", ""),
        }
        request_id = response.headers.get("x-request-id")
        if request_id:
            fields["request_id"] = request_id
        fields.update(request.get(_FIELDS) or {})
        self.logger.log(level, "%s %s %d %.1f ms", request.method, request.path, fields["http_status"], duration_ms,
                        extra=fields)


def _client_parse_error(record: logging.LogRecord) -> bool:
    """A filter of aiohttp's server logger: a request its parser refused becomes one info line, without a
    traceback; every other record passes as it is."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, HttpProcessingError):
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "%s: refused by the HTTP parser (400): %s", (record.getMessage(), str(error.message)[:200]), None, None)
    return True


def log_parse_errors_as_client_errors() -> None:
    """Called once by a gateway's CLI, beside ``configure_logging``: see the module's docstring."""
    server_log = logging.getLogger("aiohttp.server")
    if _client_parse_error not in server_log.filters:
        server_log.addFilter(_client_parse_error)
