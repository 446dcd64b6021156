"""Batches of the Batch API: ``POST/GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel``.

A batch is a Redis hash (status, timestamps, request counts, the driver's
cursors) listed in a sorted set by creation time and, until it ends, in the
set of active batches that `batch_driver` moves along. Its status moves only
through `BatchStore.move`, a compare-and-set, so a cancel and the driver
never overwrite each other:

    validating -> in_progress -> finalizing -> completed | expired | cancelled
    validating -> failed                      (the input file cannot be read)
    validating | in_progress -> cancelling -> finalizing -> cancelled

A batch created with carpool's own ``webhook: {"url"}`` gets one signed
callback when it ends, in OpenAI's event shape (``batch.completed``,
``batch.failed``, ``batch.expired`` or ``batch.cancelled``), enqueued by the
same script that ends it and delivered by the webhook dispatcher.
"""

from __future__ import annotations

import json
import secrets
import time
from enum import Enum
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from redis.typing import EncodableT, FieldT

from gateway import appkeys
from gateway.access_log import note
from gateway.admission import InvalidJob
from gateway.auth import caller_of, may_see
from gateway.errors import NO_RETRY, OpenAIError, invalid, unsupported
from gateway.openai.files import expiry_seconds, file_store
from gateway.openai.listing import cursor_page
from gateway.openai.online import read_json
from gateway.openai.schema import Endpoint, check_metadata
from scheduler.protocol import state_machine
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import as_bytes, read_hash
from scheduler.protocol.tenants import DEFAULT_TENANT, tenant_of
from scheduler.protocol.webhooks import BatchEvent, batch_delivery_fields
from scheduler.protocol.wire_values import is_text
from scheduler.telemetry.otel import traceparent_of

routes = web.RouteTableDef()

COMPLETION_WINDOWS_S = {"24h": 24 * 3600}


class BatchStatus(str, Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# The hash field holding the unix time each status was entered.
TIME_FIELDS = {BatchStatus.IN_PROGRESS: "in_progress_at", BatchStatus.FINALIZING: "finalizing_at",
               BatchStatus.COMPLETED: "completed_at", BatchStatus.FAILED: "failed_at",
               BatchStatus.EXPIRED: "expired_at", BatchStatus.CANCELLING: "cancelling_at",
               BatchStatus.CANCELLED: "cancelled_at"}
COUNTERS = ("completed", "failed", "expired", "settled", "enqueued", "low", "blank", "input_tokens", "cached_tokens",
            "output_tokens")
"""The batch hash's counters (besides ``total``, the input file's lines), all 0 until validation starts them
over. ``blank`` counts the blank lines, which are settled at once and are no requests."""

END_EVENTS = {BatchStatus.COMPLETED: BatchEvent.COMPLETED, BatchStatus.FAILED: BatchEvent.FAILED,
              BatchStatus.EXPIRED: BatchEvent.EXPIRED, BatchStatus.CANCELLED: BatchEvent.CANCELLED}


HELD_AFTER_WINDOW_S = 3600
"""How long past its completion window a batch's input file lines are kept for it at the latest (it reads none
after the window; they are dropped as soon as it has read them all)."""


class BatchStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self._redis, self._keys, self.ttl_s = redis, keys, ttl_s
        self._move = redis.register_script(state_machine.BATCH_MOVE)

    async def create(self, input_file_id: str, endpoint: Endpoint, window_s: int, window: str,
                     metadata: dict[str, str] | None, tenant: str = DEFAULT_TENANT,
                     webhook_url: str | None = None, output_ttl_s: int | None = None,
                     traceparent: str | None = None) -> dict[str, Any]:
        """A new batch, validating; `traceparent`: the creating request's, which every line's trace links to."""
        batch_id = "batch_" + secrets.token_hex(12)
        created_s = time.time()
        now = int(created_s)
        fields: dict[FieldT, EncodableT] = {
            "id": batch_id, "status": BatchStatus.VALIDATING.value, "endpoint": endpoint.value,
            "input_file_id": input_file_id, "completion_window": window, "created_at": now,
            "expires_at": now + window_s, "metadata": json.dumps(metadata), "tenant": tenant,
            "total": 0, **{name: 0 for name in COUNTERS},
            **({"webhook_url": webhook_url} if webhook_url else {}),
            **({"output_ttl_s": output_ttl_s} if output_ttl_s is not None else {}),
            **({"traceparent": traceparent} if traceparent else {}),
        }
        key = self._keys.batch(batch_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.ttl_s)
            pipe.zadd(self._keys.batches, {batch_id: created_s})  # sub-second: newest first within a second too
            pipe.zremrangebyscore(self._keys.batches, "-inf", now - self.ttl_s)  # expired ones
            pipe.sadd(self._keys.batches_active, batch_id)
            await pipe.execute()
        return await self.view(batch_id) or {}

    async def read(self, batch_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in (await read_hash(self._redis, self._keys.batch(batch_id))).items()}

    async def move(self, batch_id: str, allowed: tuple[BatchStatus, ...], to: BatchStatus,
                   **fields: str | int) -> bool:
        """Set the status to `to` if it is one of `allowed` (stamping its time field); whether it moved.

        A move to a final status also enqueues the batch's webhook (``batch.completed`` and so on), when it
        has one, in the same script: a batch ends once, with one callback.
        """
        now = int(time.time())
        stamped: dict[str, str | int] = {**({TIME_FIELDS[to]: now} if to in TIME_FIELDS else {}), **fields}
        args: list[EncodableT] = [",".join(s.value for s in allowed), to.value, 2 * len(stamped)]
        for name, value in stamped.items():
            args += [name, value]
        if to in END_EVENTS:
            b = await self.read(batch_id)
            if b.get("webhook_url"):
                ended = self.view_of({**b, **{k: str(v) for k, v in stamped.items()}, "status": to.value})
                delivery = batch_delivery_fields(batch_id, END_EVENTS[to], b["webhook_url"], ended, now=now)
                args += [v for pair in delivery.items() for v in pair]
        found = await self._move(keys=[self._keys.batch(batch_id), self._keys.webhooks], args=args)
        return found is not None and found.decode() in {s.value for s in allowed}

    async def tenant(self, batch_id: str) -> str:
        """Whose the batch is (batches made before tenants existed are the default tenant's)."""
        raw = await self._redis.hget(self._keys.batch(batch_id), "tenant")
        return tenant_of(None if raw is None else as_bytes(raw).decode())

    async def view(self, batch_id: str) -> dict[str, Any] | None:
        b = await self.read(batch_id)
        return self.view_of(b) if b else None

    @staticmethod
    def view_of(b: dict[str, str]) -> dict[str, Any]:
        """The batch object OpenAI's API shows, from the batch hash."""
        out: dict[str, Any] = {
            "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "errors": json.loads(b.get("errors", "null")),
            "input_file_id": b["input_file_id"], "completion_window": b["completion_window"], "status": b["status"],
            "output_file_id": b.get("output_file_id"), "error_file_id": b.get("error_file_id"),
            "created_at": int(b["created_at"]), "expires_at": int(b["expires_at"]),
            "request_counts": {"total": int(b["total"]) - int(b.get("blank", 0)), "completed": int(b["completed"]),
                               "failed": int(b["failed"])},
            "metadata": json.loads(b.get("metadata", "null")), "model": b.get("model"),
            "usage": {"input_tokens": int(b.get("input_tokens", 0)),
                      "input_tokens_details": {"cached_tokens": int(b.get("cached_tokens", 0))},
                      "output_tokens": int(b.get("output_tokens", 0)),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": int(b.get("input_tokens", 0)) + int(b.get("output_tokens", 0))},
        }
        for name in TIME_FIELDS.values():
            out[name] = int(b[name]) if name in b else None
        return out


def batch_store(app: web.Application) -> BatchStore:
    return BatchStore(app[appkeys.REDIS], app[appkeys.KEYS], app[appkeys.CONFIG].file_ttl_s)


@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    for name in body:
        if name not in ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after",
                        "webhook"):
            raise unsupported(str(name))
    try:
        endpoint = Endpoint(body.get("endpoint"))
    except ValueError as e:
        raise invalid("endpoint", f"must be one of {[x.value for x in Endpoint]}") from e
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOWS_S:
        raise invalid("completion_window", f"must be one of {sorted(COMPLETION_WINDOWS_S)}")
    metadata = None if body.get("metadata") is None else check_metadata(body["metadata"])
    output_ttl_s = (None if body.get("output_expires_after") is None else
                    expiry_seconds("output_expires_after", body["output_expires_after"],
                                   request.app[appkeys.CONFIG].file_ttl_s))
    file_id = body.get("input_file_id")
    if file_id is None:
        raise invalid("input_file_id", "required: the id of a file uploaded with purpose batch (POST /v1/files)")
    if not isinstance(file_id, str):
        raise invalid("input_file_id", "must be a string: the id of a file uploaded with purpose batch")
    files = file_store(request.app)
    file = await files.get(file_id) if is_text(file_id) else None  # (a lone surrogate names no file)
    if file is None or not may_see(request, await files.tenant(file_id)):
        raise invalid("input_file_id", f"no such file: {file_id!r}")
    if file["purpose"] != "batch":
        raise invalid("input_file_id", "the file's purpose must be batch")
    webhook_url = await _webhook_url(request, body.get("webhook"))
    view = await batch_store(request.app).create(file_id, endpoint, COMPLETION_WINDOWS_S[window], window, metadata,
                                                 caller_of(request).tenant, webhook_url, output_ttl_s,
                                                 traceparent_of())
    # Deleting the input file (upload, create, delete) or its expiry leaves the batch its lines.
    await files.hold(file_id, view["id"], int(view["expires_at"]) + HELD_AFTER_WINDOW_S)
    note(request, batch_id=view["id"], file_id=file_id)
    return web.json_response(view)


async def _webhook_url(request: web.Request, webhook: object) -> str | None:
    """carpool's own ``webhook: {"url"}``: called, signed, when the batch ends (``batch.completed`` and so on)."""
    if webhook is None:
        return None
    if not isinstance(webhook, dict) or set(webhook) != {"url"} or not isinstance(webhook["url"], str):
        raise invalid("webhook", 'must be {"url": "https://..."}')
    try:
        await request.app[appkeys.ADMISSION].check_webhook_url(webhook["url"])
    except InvalidJob as e:
        raise invalid("webhook.url", e.message) from e
    return webhook["url"]


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    store = batch_store(request.app)

    async def may_name_batch(batch_id: str) -> bool:
        b = await store.read(batch_id)
        return not b or may_see(request, tenant_of(b.get("tenant")))  # an expired one is still a place in the list

    async def load(batch_id: str) -> dict[str, Any] | None:
        b = await store.read(batch_id)  # one read gives both whose the batch is and its object
        return store.view_of(b) if b and may_see(request, tenant_of(b.get("tenant"))) else None

    page = await cursor_page(request, request.app[appkeys.REDIS], request.app[appkeys.KEYS].batches, load,
                             may_name_batch, default_limit=20, max_limit=100)
    return web.json_response(page)


@routes.get("/v1/batches/{id}")
async def get_batch(request: web.Request) -> web.Response:
    return web.json_response(await _existing(request))


@routes.post("/v1/batches/{id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    """Cancel a batch that has not ended: 200 with the batch ``cancelling`` (also when a cancel is already under
    way); 409 ``batch_not_cancellable`` for a batch that has ended or is writing its results."""
    view = await _existing(request)
    store = batch_store(request.app)
    await store.move(view["id"], (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS), BatchStatus.CANCELLING)
    b = await store.read(view["id"])
    status = BatchStatus(b["status"])
    if status is BatchStatus.CANCELLING or (status is BatchStatus.FINALIZING
                                            and b.get("outcome") == BatchStatus.CANCELLED.value):
        return web.json_response(store.view_of(b))
    why = ("is writing its results" if status is BatchStatus.FINALIZING else "has already ended")
    raise OpenAIError(409, f"Batch {view['id']} cannot be cancelled: it {why} (status {status.value}).",
                      param="batch_id", code="batch_not_cancellable", headers=NO_RETRY)


async def _existing(request: web.Request) -> dict[str, Any]:
    batch_id = request.match_info["id"]
    store = batch_store(request.app)
    view = await store.view(batch_id)
    if view is None or not may_see(request, await store.tenant(batch_id)):
        raise OpenAIError(404, f"No such batch: {batch_id}", param="batch_id", code="not_found")
    return view
