"""API-key authentication: every ``/v1`` route needs ``Authorization: Bearer <key>`` when keys are on.

The caller (tenant and limits) is put on the request for the handlers; a missing, malformed, unknown or
revoked key is answered 401 in the route's own error shape. ``/healthz``, ``/readyz`` and ``/metrics`` stay
open. With keys off every request is the default tenant's, unlimited.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway import appkeys
from gateway.api_keys import OPEN_CALLER, Caller
from gateway.errors import Handler, OpenAIError, error_response, is_openai_path, openai_error_response

CALLER = web.RequestKey("caller", Caller)
RATE_HEADERS = web.RequestKey("rate_headers", dict)
"""The x-ratelimit-* headers a limited request earned; added to its answer if it is not a stream."""

PROTECTED_PREFIX = "/v1"


def caller_of(request: web.Request) -> Caller:
    return request.get(CALLER, OPEN_CALLER)


def may_see(request: web.Request, tenant: str) -> bool:
    """Whether the caller may see (and cancel) what belongs to `tenant`: its own only, with keys on."""
    caller = caller_of(request)
    return not caller.is_keyed or caller.tenant == tenant


def _unauthorized(request: web.Request, message: str) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="carpool"'}
    if is_openai_path(request.path):
        return openai_error_response(401, message, code="invalid_api_key", headers=headers)
    return error_response(401, "unauthorized", message, field="Authorization", **headers)


def auth_middleware(is_on: bool) -> Middleware:
    """The middleware; `is_on`: whether keys are required (``--api-keys``)."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_on or not (request.path == PROTECTED_PREFIX or request.path.startswith(PROTECTED_PREFIX + "/")):
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return _unauthorized(request, "Missing API key: send 'Authorization: Bearer <key>'.")
        found = await request.app[appkeys.KEY_STORE].lookup(key.strip())
        if found is None:
            return _unauthorized(request, "Incorrect API key provided (unknown or revoked).")
        request[CALLER] = Caller(found.tenant, found.limits, is_keyed=True)
        try:
            response = await handler(request)
        except OpenAIError as e:
            # A request admitted, then answered with its job's error (a prompt the worker found too long): it
            # counted, and its answer says how the window stands, as a success's would.
            e.headers = {**request.get(RATE_HEADERS, {}), **e.headers}
            raise
        headers = request.get(RATE_HEADERS)
        if headers and not response.prepared:
            response.headers.update(headers)
        return response

    return auth

