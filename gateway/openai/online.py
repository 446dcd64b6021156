"""Online OpenAI routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Each request becomes one job per choice, admitted exactly as ``POST /v1/jobs``
admits jobs (same lanes, depth limits and 429s). The handler subscribes to
the jobs' events before it enqueues them, so no event is missed, and cancels
whatever is still running when it leaves early: a client that hangs up (on a
stream or while waiting for a whole answer) leaves no orphaned compute.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from aiohttp import web

from gateway import appkeys
from gateway.access_log import client_gone, note_jobs
from gateway.auth import RATE_HEADERS, caller_of
from gateway.errors import OpenAIError, invalid
from gateway.openai import responses
from gateway.openai.choices import ChoiceWatch, cancel_jobs, check_model, served_models, submit_choices
from gateway.openai.schema import Endpoint, parse_request
from gateway.openai.streaming import stream_choices
from gateway.sse import CLIENT_CHECK_S
from scheduler.protocol.lanes import Lane
from scheduler.protocol.wire_values import decode_failure, loads_json

routes = web.RouteTableDef()

DEFAULT_LANES = {Endpoint.CHAT: Lane.INTERACTIVE, Endpoint.COMPLETIONS: Lane.STANDARD}
ID_PREFIXES = {Endpoint.CHAT: "chatcmpl-", Endpoint.COMPLETIONS: "cmpl-"}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    models = await served_models(request.app)
    data = [{"id": name, "object": "model", "created": int(seen), "owned_by": "carpool"}
            for name, seen in sorted(models.items())]
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    models = await served_models(request.app)
    if name not in models:
        raise OpenAIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return web.json_response({"id": name, "object": "model", "created": int(models[name]), "owned_by": "carpool"})


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, Endpoint.COMPLETIONS)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, Endpoint.CHAT)


async def read_json(request: web.Request) -> Any:
    try:
        return await request.json(loads=loads_json)
    except (ValueError, RecursionError, LookupError) as e:  # LookupError: an unknown charset
        raise invalid("body", f"not valid JSON: {decode_failure(e)}") from e


async def _complete(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    app = request.app
    try:
        req = parse_request(endpoint, await read_json(request), default_lane=DEFAULT_LANES[endpoint])
        await check_model(app, req.model)
    except OpenAIError as e:
        if e.status in (400, 404):  # a body no job can be made of, or a model no worker serves
            app[appkeys.METRICS].job_rejected("invalid")
        raise
    request_id = ID_PREFIXES[endpoint] + secrets.token_hex(12)
    job_ids = [f"{request_id}-{i}" for i in range(len(req.jobs))]
    created = int(time.time())
    metrics = app[appkeys.METRICS]
    metrics.waiter_opened()
    try:
        async with ChoiceWatch(app[appkeys.REDIS], app[appkeys.HUB], app[appkeys.KEYS], job_ids) as watch:
            request[RATE_HEADERS] = await submit_choices(app, req, job_ids, caller_of(request))
            note_jobs(request, job_ids)
            try:
                if req.is_stream:
                    return await stream_choices(request, req, watch, request_id, created)
                views = await _wait_all(request, watch)
            finally:
                await asyncio.shield(cancel_jobs(app, job_ids))
    finally:
        metrics.waiter_closed()
    for view in views:
        if view.get("status") != "succeeded":
            raise responses.job_error(view, req.renames)
    return web.json_response(responses.completion_object(endpoint, request_id, created, req.model, views))


async def _wait_all(request: web.Request, watch: ChoiceWatch) -> list[dict[str, Any]]:
    """Every choice's final view; raises if the client hangs up first (the caller cancels the jobs)."""
    heartbeat_s = request.app[appkeys.CONFIG].sse_heartbeat_s
    views: dict[int, dict[str, Any]] = {}
    last_check = time.monotonic()
    while len(views) < len(watch.job_ids):
        # Checked at every event too: a running job sends one each step, so its waiter is never idle.
        if client_gone(request):
            raise OpenAIError(499, "the client closed the connection", code="client_closed")
        got = await watch.next(CLIENT_CHECK_S)
        if got is None:
            if time.monotonic() - last_check >= heartbeat_s:
                last_check = time.monotonic()
                views.update(await watch.terminal_views([i for i in range(len(watch.job_ids)) if i not in views]))
            continue
        index, event = got
        if event["type"] == "closed":
            raise OpenAIError(503, "the server is shutting down; retry", code="shutting_down")
        if event["type"] == "final":
            views[index] = event["job"]
    return [views[i] for i in range(len(views))]
