"""HTTP handlers: parse the request, call the domain object, turn its errors into HTTP."""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from urllib.parse import quote

from aiohttp import web
from redis.exceptions import RedisError

from gateway import appkeys
from gateway.access_log import CLIENT_CLOSED_REQUEST, client_gone, note_client_gone, note_jobs
from gateway.admission import IdempotencyInFlight, InvalidJob, JobIdTaken, LaneFull, QuotaExceeded
from gateway.auth import RATE_HEADERS, caller_of, may_see
from gateway.cancel import AlreadyFinished, JobNotFound
from gateway.errors import error_response
from gateway.event_hub import wait_for_terminal
from gateway.metrics import CONTENT_TYPE
from gateway.rate_limits import RateLimited, TooManyTokens, job_tokens
from gateway.sse import CLIENT_CHECK_S, stream_events
from scheduler.protocol.job_record import job_view, json_default, tenant_of_record
from scheduler.protocol.lanes import LANES
from scheduler.protocol.redis_client import is_out_of_memory, is_refusal
from scheduler.protocol.redis_replies import REDIS_UNAVAILABLE, read_hash
from scheduler.protocol.wire_values import decode_failure, loads_json
from scheduler.protocol.worker_heartbeats import live_workers
from scheduler.telemetry.log_format import job_context
from scheduler.telemetry.stream_stats import read_stream_counts

log = logging.getLogger(__name__)

routes = web.RouteTableDef()

_dumps = functools.partial(json.dumps, default=json_default)

_REFUSALS = (InvalidJob, QuotaExceeded, LaneFull, IdempotencyInFlight)
"""What `Admission.enqueue` raises having enqueued nothing, so the request's reservation goes back."""
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+")
"""A ``?wait=`` in seconds: ``30``, ``2.5``, ``.5``, ``1e9``."""


def _lane_named(body: object) -> str | None:
    """The lane a refused body named, where it named one that is a lane (the metrics' label; None: unknown)."""
    lane = body.get("lane") if isinstance(body, dict) else None
    return lane if isinstance(lane, str) and lane in {known.value for known in LANES} else None


@routes.post("/v1/jobs")
async def post_job(request: web.Request) -> web.Response:
    app = request.app
    metrics, admission, limiter = app[appkeys.METRICS], app[appkeys.ADMISSION], app[appkeys.LIMITER]
    caller = caller_of(request)
    try:
        body = await request.json(loads=loads_json)
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; an unknown charset, a LookupError.
    except (ValueError, RecursionError, LookupError) as e:
        metrics.job_rejected("invalid")
        return error_response(400, "invalid_request", f"body is not valid JSON: {decode_failure(e)}", field="body")
    idempotency_key = request.headers.get("Idempotency-Key")
    try:
        spec = await admission.validate(body, caller)
        # A retry is answered before it counts against the tenant's limits (without limits, enqueue answers it).
        admitted = await admission.find(spec, idempotency_key) if caller.limits.is_rate_limited else None
        if admitted is None:
            cost = job_tokens(spec.to_wire(), await admission.context_length())
            reserved, request[RATE_HEADERS] = await limiter.reserve(caller, [cost])
            try:
                admitted = await admission.enqueue(spec, idempotency_key, caller=caller, reservation=reserved.jobs[0])
            except _REFUSALS:
                request[RATE_HEADERS] = await limiter.release(caller, reserved)
                raise
            if not admitted.is_new:
                request[RATE_HEADERS] = await limiter.release(caller, reserved)
    except JobIdTaken as e:  # raised once the body is valid: its lane is known
        metrics.job_rejected("conflict", spec.lane.value)
        return error_response(409, "conflict", e.message, field=e.field)
    except InvalidJob as e:
        metrics.job_rejected("invalid", _lane_named(body))
        return error_response(400, "invalid_request", e.message, field=e.field)
    # A tenant's limits refuse a job already validated: its lane is known.
    except TooManyTokens as e:
        metrics.job_rejected("rate_limited", spec.lane.value)
        return error_response(400, "invalid_request", str(e), field="params.max_tokens")
    except RateLimited as e:
        metrics.job_rejected("rate_limited", spec.lane.value)
        return error_response(429, "rate_limited", e.message, **e.headers)
    except QuotaExceeded as e:
        metrics.job_rejected("quota", spec.lane.value)
        retry_after = str(app[appkeys.CONFIG].retry_after_s)
        return error_response(429, "quota_exceeded", str(e), **{"Retry-After": retry_after})
    except LaneFull as e:
        metrics.job_rejected("lane_full", e.lane.value)
        retry_after = str(app[appkeys.CONFIG].retry_after_s)
        return error_response(429, "lane_full", str(e), field="lane", **{"Retry-After": retry_after})
    except IdempotencyInFlight as e:
        metrics.job_rejected("conflict", spec.lane.value)
        return error_response(409, "conflict", f"a request with this Idempotency-Key is still creating job {e}",
                              field="Idempotency-Key", **{"Retry-After": "1"})
    note_jobs(request, [admitted.job_id])
    if admitted.is_new:
        metrics.job_submitted(admitted.lane)
    else:
        metrics.job_deduplicated()
    return web.json_response(
        {"id": admitted.job_id, "status": admitted.status},
        status=202 if admitted.is_new else 200,
        # An id may hold any character (`/`, `?`, non-ASCII): the URL carries it percent-encoded.
        headers={"Location": f"/v1/jobs/{quote(admitted.job_id, safe='')}"},
    )


def _no_job(job_id: str) -> web.Response:
    # A job XADDed straight into a lane gets its record when a worker takes it: until then it is unknown here.
    return error_response(404, "not_found", f"no job {job_id!r}: unknown, expired, or added straight to a lane "
                          "and not yet taken by a worker (its record is made then)", field="id")


async def _is_visible(request: web.Request, job_id: str) -> bool:
    """Whether the job exists and belongs to the caller's tenant (another tenant's job is as good as absent)."""
    app = request.app
    record = await read_hash(app[appkeys.REDIS], app[appkeys.KEYS].job(job_id))
    return bool(record) and may_see(request, tenant_of_record(record))


@routes.get("/v1/jobs/{id:[^/]+}")
async def get_job(request: web.Request) -> web.Response:
    app = request.app
    job_id = request.match_info["id"]
    wait_s = 0.0
    if "wait" in request.query:
        raw = request.query["wait"].strip()
        # Digits as a number is written (no `1_0`, no `nan`); any length of wait is capped below, `inf` too.
        if not _SECONDS.fullmatch(raw) and raw.lower() not in ("inf", "infinity"):
            return error_response(400, "invalid_request", "must be a non-negative number of seconds", field="wait")
        wait_s = float(raw)
    wait_s = min(wait_s, app[appkeys.CONFIG].max_wait_s)
    if not await _is_visible(request, job_id):
        return _no_job(job_id)
    metrics = app[appkeys.METRICS]
    metrics.waiter_opened()
    try:
        record = await wait_for_terminal(app[appkeys.REDIS], app[appkeys.HUB], app[appkeys.KEYS], job_id, wait_s,
                                         is_abandoned=lambda: client_gone(request), check_s=CLIENT_CHECK_S)
    finally:
        metrics.waiter_closed()
    if client_gone(request):
        return web.Response(status=CLIENT_CLOSED_REQUEST)  # hung up while it waited: nobody reads an answer
    if not record:
        return _no_job(job_id)
    return web.json_response(job_view(record), dumps=_dumps)


@routes.get("/v1/jobs/{id:[^/]+}/events")
async def job_events(request: web.Request) -> web.StreamResponse:
    app = request.app
    redis, keys = app[appkeys.REDIS], app[appkeys.KEYS]
    job_id = request.match_info["id"]
    if not await _is_visible(request, job_id):
        return _no_job(job_id)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    app[appkeys.METRICS].waiter_opened()
    try:
        await stream_events(request, response, redis, keys, app[appkeys.HUB], job_id, app[appkeys.CONFIG].sse_heartbeat_s)
    except ConnectionResetError:
        # The client went away mid-stream (it may come back with Last-Event-ID): an ordinary end.
        note_client_gone(request)
        with job_context(job_id):
            log.debug("event stream of job %s: client disconnected", job_id)
    except REDIS_UNAVAILABLE as e:
        if not response.prepared:
            raise  # answered 503 by the error middleware
        with job_context(job_id):
            log.warning("event stream of job %s: ended early, Redis unavailable: %s", job_id, e)
    finally:
        app[appkeys.METRICS].waiter_closed()
    return response


@routes.delete("/v1/jobs/{id:[^/]+}")
async def delete_job(request: web.Request) -> web.Response:
    job_id = request.match_info["id"]
    if not await _is_visible(request, job_id):
        return _no_job(job_id)
    try:
        outcome = await request.app[appkeys.CANCELLER].cancel(job_id)
    except JobNotFound:
        return _no_job(job_id)
    except AlreadyFinished as e:
        return error_response(409, "conflict", f"job {job_id!r} already {e.status}", field="id")
    return web.json_response(outcome.view, status=202, dumps=_dumps)


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    app = request.app
    redis, keys = app[appkeys.REDIS], app[appkeys.KEYS]
    try:
        await redis.ping()
        counts = await read_stream_counts(redis, keys)
        workers = await live_workers(redis, keys.workers, max_age_s=app[appkeys.CONFIG].model_heartbeat_max_age_s,
                                     now=time.time())
    except (RedisError, OSError) as e:
        state = ("at maxmemory, refusing writes" if is_out_of_memory(e)
                 else "refusing this gateway's user" if is_refusal(e) else "unreachable")
        return web.json_response({"status": "unavailable", "redis": f"{state}: {e}"}, status=503,
                                 headers={"Retry-After": str(app[appkeys.CONFIG].retry_after_s)})
    max_depth = app[appkeys.CONFIG].max_lane_depth
    # Entries delivered to a worker whose heartbeat stopped (killed, or handed back at its drain) wait for
    # another worker's reclaim: they count as waiting, not running, so that a pool of none is seen to be one.
    unheld = {lane: counts.held_by_others(lane, workers) for lane in LANES}
    return web.json_response({
        "status": "ready",
        "time": time.time(),
        # What an autoscaler reads: `waiting` for a worker (the backlog), `running` (held by a live worker).
        "lanes": {lane.value: {"depth": counts.depth[lane], "max_depth": max_depth[lane.value],
                               "waiting": max(counts.depth[lane] - counts.pending[lane] + unheld[lane], 0),
                               "running": counts.pending[lane] - unheld[lane]} for lane in LANES},
        "workers": workers,
    })


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    response = web.Response(body=request.app[appkeys.METRICS].render())
    response.headers["Content-Type"] = CONTENT_TYPE
    return response
