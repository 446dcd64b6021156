"""``GET /v1/usage``: the caller's own tenant: its counts so far, its current rate window and its limits."""

from __future__ import annotations

from aiohttp import web

from gateway import appkeys
from gateway.auth import caller_of
from scheduler.protocol.keys import RATE_WINDOW_MS
from scheduler.protocol.lanes import LANES

routes = web.RouteTableDef()


@routes.get("/v1/usage")
async def usage(request: web.Request) -> web.Response:
    app = request.app
    redis, keys, caller = app[appkeys.REDIS], app[appkeys.KEYS], caller_of(request)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.tenant_usage(caller.tenant))
        pipe.hgetall(keys.tenant_window(caller.tenant))
        pipe.pttl(keys.tenant_window(caller.tenant))
        pipe.get(keys.tenant_batch_lines(caller.tenant))
        for lane in LANES:
            pipe.xlen(keys.tenant_lane(lane, caller.tenant))
        raw_usage, raw_window, left_ms, raw_lines, *lengths = await pipe.execute()
    queued = sum(int(n) for n in lengths)
    counts = {k.decode(): int(v) for k, v in raw_usage.items()}
    window = {k.decode(): v.decode() for k, v in raw_window.items()}
    return web.json_response({
        "object": "usage",
        "tenant": caller.tenant,
        "jobs": counts.get("jobs", 0),
        "jobs_by_status": {k.removeprefix("jobs_"): v for k, v in sorted(counts.items()) if k.startswith("jobs_")},
        "prompt_tokens": counts.get("prompt_tokens", 0),
        "completion_tokens": counts.get("completion_tokens", 0),
        # The default tenant's lane streams also hold entries not yet routed to their tenant.
        "queued": queued,
        # Of those, the tenant's Batch API lines, which max_queued does not count.
        "batch_queued": min(int(raw_lines or 0), queued),
        "window": {
            "requests": int(window.get("requests", 0)),
            "tokens": int(window.get("tokens", 0)),
            "reset_ms": max(int(left_ms), 0) if window else 0,
            "length_ms": RATE_WINDOW_MS,
        },
        "limits": caller.limits.to_json(),
    })
