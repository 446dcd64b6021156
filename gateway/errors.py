"""Every error the gateway answers, in one JSON shape: ``{"error": {"type", "message", "field"?}}``.

Handlers answer the errors they know (400, 404, 409, 429) with `error_response`;
`error_middleware` turns the rest into the same shape at the edge: aiohttp's own
404, 405 and 413, a Redis that is down, restarting or out of free connections
(503 with ``Retry-After``), and, last, anything unexpected (500, logged).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.openai.errors import OpenAIError, is_openai_path, openai_error_response

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REDIS_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)
"""Redis unreachable, restarting, loading its data, or no pooled connection free within the pool timeout.

``OSError`` covers refused connections and ``TimeoutError`` (an ``OSError`` since Python 3.11)."""

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


def error_middleware(retry_after_s: int) -> Middleware:
    """The middleware, with the ``Retry-After`` seconds it sends with a 503.

    On the OpenAI routes every error takes OpenAI's shape instead (``{"error": {"message", "type",
    "param", "code"}}``), and their handlers may raise `OpenAIError`.
    """

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        is_openai = is_openai_path(request.path)
        try:
            return await handler(request)
        except OpenAIError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            headers = {name: e.headers[name] for name in _KEPT_HEADERS if name in e.headers}
            message = e.reason if e.text is None else _plain(e.text)
            if is_openai:
                return openai_error_response(e.status, message, headers=headers or None)
            kind = _TYPE_OF_STATUS.get(e.status, "server_error" if e.status >= 500 else "invalid_request")
            return error_response(e.status, kind, message, **headers)
        except REDIS_UNAVAILABLE as e:
            reason = str(e) or type(e).__name__
            if request.transport is None or request.transport.is_closing():
                # The client has gone (an event stream closed mid-write): nobody reads the answer.
                log.debug("%s %s: client gone: %s", request.method, request.path, reason)
            else:
                log.warning("%s %s: Redis unavailable: %s", request.method, request.path, reason)
            if is_openai:
                return openai_error_response(503, f"the job store is unavailable ({reason}); retry later",
                                             headers={"Retry-After": str(retry_after_s)})
            return unavailable_response(retry_after_s, reason)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if is_openai:
                return openai_error_response(500, "internal error; it has been logged")
            return error_response(500, "server_error", "internal error; it has been logged")

    return errors


def _plain(text: str) -> str:
    """aiohttp's error text ("404: Not Found", "Maximum request body size ... exceeded ...") as one line."""
    return " ".join(text.split())
