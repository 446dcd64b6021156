"""HTTP handlers: parse the request, call the domain object, turn its errors into HTTP."""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any

import msgpack
from aiohttp import web
from redis.exceptions import RedisError

from gateway import appkeys as K
from gateway.admission import IdempotencyInFlight, InvalidJob, LaneFull, QuotaExceeded
from gateway.auth import RATE_HEADERS, caller_of, may_see
from gateway.cancel import AlreadyFinished, JobNotFound
from gateway.errors import REDIS_UNAVAILABLE, error_response
from gateway.metrics import CONTENT_TYPE
from gateway.rate_limits import RateLimited, Reservation, job_tokens
from gateway.results import wait_for_terminal
from gateway.sse import stream_events
from scheduler.job_record import job_view, json_default, tenant_of_record
from scheduler.lanes import LANES
from scheduler.redis_replies import read_hash

log = logging.getLogger(__name__)

routes = web.RouteTableDef()

_dumps = functools.partial(json.dumps, default=json_default)


@routes.post("/v1/jobs")
async def post_job(request: web.Request) -> web.Response:
    app = request.app
    metrics, admission, caller = app[K.METRICS], app[K.ADMISSION], caller_of(request)
    try:
        body = await request.json(loads=json.loads)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        metrics.job_rejected("invalid")
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        return error_response(400, "invalid_request", f"body is not valid JSON: {reason}", field="body")
    reservations: list[Reservation | None] = [None]
    try:
        spec = await admission.validate(body, caller)
        reservations, request[RATE_HEADERS] = await app[K.LIMITER].reserve(caller, [job_tokens(spec.to_wire())])
        admitted = await admission.enqueue(spec, request.headers.get("Idempotency-Key"), caller=caller,
                                           reservation=reservations[0])
    except InvalidJob as e:
        await app[K.LIMITER].release(caller, reservations)
        metrics.job_rejected("invalid")
        return error_response(400, "invalid_request", e.message, field=e.field)
    except RateLimited as e:
        metrics.job_rejected("rate_limited")
        return error_response(429, "rate_limited", e.message, **e.headers)
    except QuotaExceeded as e:
        await app[K.LIMITER].release(caller, reservations)
        metrics.job_rejected("quota")
        retry_after = str(app[K.CONFIG].retry_after_s)
        return error_response(429, "quota_exceeded", str(e), **{"Retry-After": retry_after})
    except LaneFull as e:
        await app[K.LIMITER].release(caller, reservations)
        metrics.job_rejected("lane_full", e.lane.value)
        retry_after = str(app[K.CONFIG].retry_after_s)
        return error_response(429, "lane_full", str(e), field="lane", **{"Retry-After": retry_after})
    except IdempotencyInFlight as e:
        await app[K.LIMITER].release(caller, reservations)
        return error_response(409, "conflict", f"a request with this Idempotency-Key is still creating job {e}",
                              field="Idempotency-Key", **{"Retry-After": "1"})
    if admitted.is_new:
        metrics.job_submitted(admitted.lane)
    else:
        await app[K.LIMITER].release(caller, reservations)
        metrics.job_deduplicated()
    return web.json_response(
        {"id": admitted.job_id, "status": admitted.status},
        status=202 if admitted.is_new else 200,
        headers={"Location": f"/v1/jobs/{admitted.job_id}"},
    )


async def _is_visible(request: web.Request, job_id: str) -> bool:
    """Whether the job exists and belongs to the caller's tenant (another tenant's job is as good as absent)."""
    app = request.app
    record = await read_hash(app[K.REDIS], app[K.KEYS].job(job_id))
    return bool(record) and may_see(request, tenant_of_record(record))


@routes.get("/v1/jobs/{id}")
async def get_job(request: web.Request) -> web.Response:
    app = request.app
    job_id = request.match_info["id"]
    wait_s = 0.0
    if "wait" in request.query:
        try:
            wait_s = float(request.query["wait"])
        except ValueError:
            return error_response(400, "invalid_request", "must be a number of seconds", field="wait")
        if not 0 <= wait_s < float("inf"):
            return error_response(400, "invalid_request", "must be a non-negative number of seconds", field="wait")
    wait_s = min(wait_s, app[K.CONFIG].max_wait_s)
    if not await _is_visible(request, job_id):
        return error_response(404, "not_found", f"no job {job_id!r} (unknown or expired)", field="id")
    metrics = app[K.METRICS]
    metrics.waiter_opened()
    try:
        record = await wait_for_terminal(app[K.REDIS], app[K.HUB], app[K.KEYS], job_id, wait_s)
    finally:
        metrics.waiter_closed()
    if not record:
        return error_response(404, "not_found", f"no job {job_id!r} (unknown or expired)", field="id")
    return web.json_response(job_view(record), dumps=_dumps)


@routes.get("/v1/jobs/{id}/events")
async def job_events(request: web.Request) -> web.StreamResponse:
    app = request.app
    redis, keys = app[K.REDIS], app[K.KEYS]
    job_id = request.match_info["id"]
    if not await _is_visible(request, job_id):
        return error_response(404, "not_found", f"no job {job_id!r} (unknown or expired)", field="id")
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    app[K.METRICS].waiter_opened()
    try:
        await stream_events(request, response, redis, keys, app[K.HUB], job_id, app[K.CONFIG].sse_heartbeat_s)
    except ConnectionResetError:
        # The client went away mid-stream (it may come back with Last-Event-ID): an ordinary end.
        log.debug("event stream of job %s: client disconnected", job_id)
    except REDIS_UNAVAILABLE as e:
        if not response.prepared:
            raise  # answered 503 by the error middleware
        log.warning("event stream of job %s: ended early, Redis unavailable: %s", job_id, e)
    finally:
        app[K.METRICS].waiter_closed()
    return response


@routes.delete("/v1/jobs/{id}")
async def delete_job(request: web.Request) -> web.Response:
    job_id = request.match_info["id"]
    if not await _is_visible(request, job_id):
        return error_response(404, "not_found", f"no job {job_id!r} (unknown or expired)", field="id")
    try:
        outcome = await request.app[K.CANCELLER].cancel(job_id)
    except JobNotFound:
        return error_response(404, "not_found", f"no job {job_id!r} (unknown or expired)", field="id")
    except AlreadyFinished as e:
        return error_response(409, "conflict", f"job {job_id!r} already {e.status}", field="id")
    request.app[K.METRICS].job_cancelled("queued" if outcome.is_cancelled_now else "running")
    return web.json_response(outcome.view, status=202, dumps=_dumps)


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    app = request.app
    redis, keys, admission = app[K.REDIS], app[K.KEYS], app[K.ADMISSION]
    try:
        await redis.ping()
        lanes = {lane.value: await admission.lane_depth(lane) for lane in LANES}
        raw_workers = await read_hash(redis, keys.workers)
    except (RedisError, OSError) as e:
        return web.json_response({"status": "unavailable", "redis": f"unreachable: {e}"}, status=503)
    workers: dict[str, Any] = {}
    for name, raw in raw_workers.items():
        try:
            workers[name.decode()] = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # a heartbeat in an unknown format is still a worker we can name
            workers[name.decode()] = None
    max_depth = app[K.CONFIG].max_lane_depth
    return web.json_response({
        "status": "ready",
        "time": time.time(),
        "lanes": {lane: {"depth": depth, "max_depth": max_depth[lane]} for lane, depth in lanes.items()},
        "workers": workers,
    })


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    response = web.Response(body=request.app[K.METRICS].render())
    response.headers["Content-Type"] = CONTENT_TYPE
    return response
