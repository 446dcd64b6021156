"""Every error the gateway answers, in carpool's JSON shape: ``{"error": {"type", "message", "field"?}}``,
or on the OpenAI routes in OpenAI's: ``{"error": {"message", "type", "param", "code"}}``.

Handlers answer the errors they know (400, 404, 409, 429) with `error_response`;
`error_middleware` turns the rest into the same shape at the edge: aiohttp's own
404 (no such route), 405 and 413, each with a message naming what was refused, a
Redis that is down, restarting, silent past its timeout, out of free connections or
at its ``maxmemory`` refusing writes (503 with ``Retry-After``), and, last, anything
unexpected (500, logged).

Every ``/v1`` path but carpool's own routes (``/v1/jobs…``, ``/v1/usage``) is an
OpenAI path, a path no route serves included: an OpenAI client that calls an
endpoint carpool lacks (``POST /v1/embeddings``) gets OpenAI's shape and
``Invalid URL (POST /v1/embeddings)``, as from OpenAI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import MatchInfoError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.access_log import CLIENT_CLOSED_REQUEST, client_gone
from scheduler.protocol.redis_client import is_out_of_memory, is_refusal, is_wrong_type
from scheduler.protocol.redis_replies import REDIS_UNAVAILABLE
from scheduler.runtime.outage_log import OutageLog, describe

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_TYPE_OF_STATUS = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    401: "unauthorized",
    413: "payload_too_large",
    429: "lane_full",
}

# Headers of aiohttp's own error responses worth keeping (405 names the methods it allows).
_KEPT_HEADERS = ("Allow", "Retry-After")


def error_response(status: int, kind: str, message: str, field: str | None = None, **headers: str) -> web.Response:
    body: dict[str, Any] = {"type": kind, "message": message}
    if field is not None:
        body["field"] = field
    return web.json_response({"error": body}, status=status, headers=headers or None)


def unavailable_response(retry_after_s: int, reason: str) -> web.Response:
    return error_response(503, "unavailable", f"the job store is unavailable ({reason}); retry later",
                          **{"Retry-After": str(retry_after_s)})


FORM_OVERHEAD_BYTES = 64 * 1024
"""What an upload's multipart body may hold beside its file (the boundaries, the purpose and expiry fields)."""


def error_middleware(retry_after_s: int, max_body_bytes: int, max_file_bytes: int | None = None,
                     body_timeout_s: float | None = None) -> Middleware:
    """The middleware, with the ``Retry-After`` seconds it sends with a 503 and the body limit a 413 names; a
    body announced larger than the limit (`max_file_bytes` for an upload) is refused before any of it is read,
    and one that stops arriving (no byte of it for `body_timeout_s`) is answered 408 and its connection closed.

    On the OpenAI routes every error takes OpenAI's shape instead (``{"error": {"message", "type",
    "param", "code"}}``), and their handlers may raise `OpenAIError`.
    """

    # Requests meeting an unavailable Redis: said once in a while per route, not once per request (each is in
    # the access log with its 503).
    outages = OutageLog(log, retry_s=retry_after_s, meanwhile=f"answered 503 with Retry-After {retry_after_s}s")

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        is_openai = is_openai_path(request.path)
        announced = request.content_length
        try:
            if announced is not None:
                if request.path == "/v1/files" and max_file_bytes is not None:
                    if announced > max_file_bytes + FORM_OVERHEAD_BYTES:
                        raise OpenAIError(413, f"the file is larger than this server's limit of {max_file_bytes} "
                                               "bytes", param="file", code="file_too_large")
                elif announced > max_body_bytes:
                    raise web.HTTPRequestEntityTooLarge(max_size=max_body_bytes, actual_size=announced)
            if body_timeout_s is None or not request.body_exists:
                return await handler(request)
            return await _handle_while_the_body_arrives(request, handler, body_timeout_s)
        except BodyStalled as e:
            message = f"the request body stopped arriving: no byte of it for {e.timeout_s:g} s (--body-timeout-s)"
            if is_openai:
                response = openai_error_response(408, f"body: {message}", param="body", code="request_timeout")
            else:
                response = error_response(408, "request_timeout", message, field="body")
            # Sent now and the connection closed after it: aiohttp would otherwise go on reading the rest of the
            # body for its lingering time (10 s) before closing.
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
            return response
        except OpenAIError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            headers = {name: e.headers[name] for name in _KEPT_HEADERS if name in e.headers}
            message, code = _http_error_message(request, e, max_body_bytes)
            if is_openai:
                return openai_error_response(e.status, message, code=code, headers=headers or None)
            kind = _TYPE_OF_STATUS.get(e.status, "server_error" if e.status >= 500 else "invalid_request")
            return error_response(e.status, kind, message, **headers)
        except RequestPayloadError as e:  # a body aiohttp cannot decode (a Content-Encoding it does not match)
            if client_gone(request):
                return web.Response(status=CLIENT_CLOSED_REQUEST)
            message = f"the request body cannot be read: {e}"
            if is_openai:
                return openai_error_response(400, f"body: {message}", param="body", code="invalid_body")
            return error_response(400, "invalid_request", message, field="body")
        except Exception as e:
            if client_gone(request):
                # Nobody reads the answer (a client that hung up, mid-body or mid-stream): no server fault either.
                log.debug("%s %s: client gone: %s", request.method, request.path, describe(e))
                return web.Response(status=CLIENT_CLOSED_REQUEST)
            if isinstance(e, REDIS_UNAVAILABLE) or is_out_of_memory(e) or is_refusal(e) or is_wrong_type(e):
                return _redis_unavailable(request, e, retry_after_s, is_openai, outages)
            log.exception("%s %s failed", request.method, request.path)
            if is_openai:
                return openai_error_response(500, "internal error; it has been logged")
            return error_response(500, "server_error", "internal error; it has been logged")

    return errors


class BodyStalled(Exception):
    """A request's body stopped arriving before all of it came: no byte of it for `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"no byte of the request body for {timeout_s:g} s")
        self.timeout_s = timeout_s


async def _handle_while_the_body_arrives(request: web.Request, handler: Handler, timeout_s: float) -> web.StreamResponse:
    """The handler's answer, or `BodyStalled` where the request's body stops arriving: whatever the handler awaits
    then (the body, mostly) is cancelled once no byte of it came for `timeout_s`. A body that keeps coming,
    however slowly, is waited for; once all of it is in, the handler has no deadline (a long poll, a stream)."""
    deadline = asyncio.timeout(None)
    try:
        async with deadline:
            watch = asyncio.create_task(_watch_body(request.content, deadline, timeout_s), name="request body watch")
            try:
                return await handler(request)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
    except TimeoutError:
        if deadline.expired():
            raise BodyStalled(timeout_s) from None
        raise


async def _watch_body(content: StreamReader, deadline: asyncio.Timeout, timeout_s: float) -> None:
    """Keep `deadline` `timeout_s` (and a check's interval) past the last time the body grew or held bytes the
    handler had not read yet, until all of it is in; then lift it. Bytes waiting unread are the gateway's wait,
    not the client's: aiohttp stops reading the socket while they fill its buffer, and the handler may be busy
    before it reads (a key looked up in a slow Redis)."""
    loop = asyncio.get_running_loop()
    check_s = timeout_s / 4
    received = -1
    while not content.is_eof():
        unread: int = getattr(content, "_size", 0)  # the bytes buffered, not yet read: aiohttp has no public name
        if content.total_bytes != received or unread > 0:
            received = content.total_bytes
            deadline.reschedule(loop.time() + timeout_s + check_s)
        await asyncio.sleep(check_s)
    deadline.reschedule(None)


POOL_EXHAUSTED = "No connection available"
"""What redis-py says when no pooled connection came free in time."""


def _redis_unavailable(request: web.Request, error: Exception, retry_after_s: int, is_openai: bool,
                       outages: OutageLog) -> web.Response:
    """The 503 for a Redis that cannot serve the request now; the reason says which way, and what to repeat."""
    if is_out_of_memory(error):
        reason = "Redis is at its maxmemory and refuses writes"
    elif is_refusal(error):
        # No wait mends it: the operator must give the gateway's Redis user what it needs.
        reason = f"Redis refuses this gateway's user a command it needs ({error})"
    elif is_wrong_type(error):
        # Nor this: a key of carpool's was overwritten with another type (a lane RPUSHed to, say).
        reason = ("a key this request needs holds another Redis type than carpool's (WRONGTYPE: a lane stream "
                  "overwritten with a list, say); an operator must delete or mend it (a worker's log names a lane "
                  "it reads, this gateway's log the request)")
    elif isinstance(error, RedisConnectionError) and POOL_EXHAUSTED in str(error):
        # Redis is fine: this gateway has more requests waiting on it than connections to carry them.
        reason = ("every one of this gateway's pooled Redis connections stayed busy past --redis-pool-timeout-s "
                  "(--redis-max-connections bounds them)")
    else:
        reason = str(error) or type(error).__name__
    if is_refusal(error) or is_wrong_type(error):
        log.error("%s %s: %s", request.method, request.path, reason)
    else:
        resource = request.match_info.route.resource  # none for a path no route takes: all of those are one place
        outages.warn(f"{request.method} {resource.canonical if resource is not None else '(no route)'}", error,
                     detail=reason if reason != describe(error) else "")
    if isinstance(error, RedisTimeoutError) and request.method not in ("GET", "HEAD"):
        # The command may have run before Redis went silent: only a repeat that names the same job is safe,
        # which the OpenAI routes (fresh ids, no Idempotency-Key) cannot do.
        reason += "; it may have been carried out" + (
            "" if is_openai else ": repeat it with the same Idempotency-Key or id")
    if is_openai:
        return openai_error_response(503, f"the job store is unavailable ({reason}); retry later",
                                     headers={"Retry-After": str(retry_after_s)})
    return unavailable_response(retry_after_s, reason)


def _http_error_message(request: web.Request, e: web.HTTPException, max_body_bytes: int) -> tuple[str, str | None]:
    """(message, OpenAI code) of an aiohttp error: what was refused, in words, rather than aiohttp's stock text."""
    is_unrouted = isinstance(request.match_info, MatchInfoError)
    if e.status == 404 and is_unrouted:
        return f"Invalid URL ({request.method} {request.path})", "unknown_url"
    if e.status == 405:
        allowed = e.headers.get("Allow", "")
        return (f"Method {request.method} is not allowed on {request.path}"
                + (f"; allowed: {allowed.replace(',', ', ')}" if allowed else ""), "method_not_allowed")
    if e.status == 413:
        return (f"The request body is larger than this server's limit of {max_body_bytes} bytes",
                "request_too_large")
    return e.reason if e.text is None else " ".join(e.text.split()), None


# ---- the OpenAI routes' shape ------------------------------------------------------------------

CARPOOL_V1_ROUTES = frozenset({"jobs", "usage"})
"""The first segments after ``/v1/`` of carpool's own routes; every other ``/v1`` path is OpenAI's."""

_OPENAI_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def is_openai_path(path: str) -> bool:
    """Whether errors on `path` take OpenAI's shape: every ``/v1`` path but carpool's own routes."""
    parts = path.split("/", 3)
    return len(parts) >= 2 and parts[1] == "v1" and (len(parts) == 2 or parts[2] not in CARPOOL_V1_ROUTES)


NO_RETRY = {"x-should-retry": "false"}
"""The header OpenAI's clients read before their own retry rules (they retry 408 and 409 by default)."""


class OpenAIError(Exception):
    """A request the OpenAI routes refuse; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return openai_error_response(self.status, self.message, param=self.param, code=self.code,
                                     headers=headers or None)


def invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


def unsupported(param: str, why: str = "is not supported by this server") -> OpenAIError:
    return OpenAIError(400, f"Unsupported parameter: '{param}' {why}.", param=param, code="unsupported_parameter")


def openai_error_body(status: int, message: str, *, param: str | None = None,
                      code: str | None = None) -> dict[str, Any]:
    """The body of an OpenAI-shaped error answer with this status."""
    kind = _OPENAI_TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                          headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(openai_error_body(status, message, param=param, code=code), status=status,
                             headers=headers)
