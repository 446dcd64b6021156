"""Admission: decide whether a submitted job enters a lane, then enqueue it atomically.

Order of checks: the body must validate into a `JobSpec` (400 naming the
field); its deadline must lie ahead and its token-id prompt must fit the
model (400); a repeated `Idempotency-Key` or job id returns the job that
already exists (nothing enqueued twice); a lane at its maximum depth refuses
with 429. Only then is the record written and the lane entry added, in one
atomic step.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from scheduler.job import JobSpec, JobStatus, JobValidationError, new_job_id
from scheduler.job_record import F_CREATED_AT, F_ID, F_LANE, F_PRIORITY, F_SPEC, F_STATUS, F_STREAM_ENTRY
from scheduler.keys import CONSUMER_GROUP, DEFAULT_LANE_MAXLEN, Keys
from scheduler.lanes import Lane
from scheduler.redis_replies import as_bytes, as_optional_bytes

MAX_IDEMPOTENCY_KEY_LEN = 255

WebhookCheck = Callable[[str], Awaitable[None]]
"""Raises ValueError (with a reason) when a webhook URL may not be used; may resolve the host."""

EnqueueSpan = Callable[[JobSpec], AbstractContextManager[object]]
"""Wraps the enqueue in a trace span and sets the spec's ``traceparent`` before it is packed."""

# Writes the record and adds the lane entry only if no record exists for this id, so a
# reused id (or two racing submissions of it) enqueues the job exactly once.
# KEYS: job record, lane stream. ARGV: ttl_s, maxlen, packed spec, then field/value pairs.
# Returns {1, entry_id} when enqueued, {0, status} when the job already existed.
_ENQUEUE_LUA = """
local status = redis.call('HGET', KEYS[1], '@status@')
if status then return {0, status} end
local entry = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'job', ARGV[3])
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
fields[#fields + 1] = '@stream_entry@'
fields[#fields + 1] = KEYS[2] .. ' ' .. entry
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {1, entry}
""".replace("@status@", F_STATUS).replace("@stream_entry@", F_STREAM_ENTRY)

# Forget an idempotency key only if it still points at the job this request tried to create.
_RELEASE_IDEMPOTENCY_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class InvalidJob(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class LaneFull(Exception):
    def __init__(self, lane: Lane, depth: int, max_depth: int) -> None:
        super().__init__(f"lane {lane.value} is full ({depth} jobs, at most {max_depth})")
        self.lane = lane


class IdempotencyInFlight(Exception):
    """Another request with the same Idempotency-Key is still being admitted."""


@dataclass(frozen=True)
class Admitted:
    job_id: str
    status: str
    lane: str
    is_new: bool


class Admission:
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, config: GatewayConfig, check_webhook: WebhookCheck | None,
        enqueue_span: EnqueueSpan = lambda spec: nullcontext(),
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._config = config
        self._check_webhook = check_webhook
        self._enqueue_span = enqueue_span
        self._enqueue = redis.register_script(_ENQUEUE_LUA)
        self._release = redis.register_script(_RELEASE_IDEMPOTENCY_LUA)

    async def validate(self, body: object) -> JobSpec:
        default_id = new_job_id()
        try:
            spec = JobSpec.from_wire(body, default_id=default_id)
        except JobValidationError as e:
            raise InvalidJob(e.field, e.message) from e
        if spec.deadline is not None and spec.deadline <= time.time():
            raise InvalidJob("deadline", "already passed")
        max_len = self._config.max_model_len
        if spec.prompt_token_ids is not None and len(spec.prompt_token_ids) >= max_len:
            raise InvalidJob(
                "prompt_token_ids",
                f"{len(spec.prompt_token_ids)} tokens leave no room to generate within the model's context of {max_len}",
            )
        # A string prompt's token count is unknown until the worker tokenizes it, and a token can
        # span many bytes, so no byte count proves it too long: the worker judges those.
        if spec.params.max_tokens >= max_len:
            raise InvalidJob("params.max_tokens", f"must be below the model's context length of {max_len}")
        if spec.webhook is not None and self._check_webhook is not None:
            try:
                await self._check_webhook(spec.webhook.url)
            except ValueError as e:
                raise InvalidJob("webhook.url", str(e).removeprefix("webhook.url: ")) from e
        return spec

    async def submit(self, body: object, idempotency_key: str | None) -> Admitted:
        spec = await self.validate(body)
        if idempotency_key is None:
            return await self._admit(spec)
        if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LEN or not idempotency_key.isprintable():
            raise InvalidJob("Idempotency-Key", f"must be 1..{MAX_IDEMPOTENCY_KEY_LEN} printable characters")
        idem = self._keys.idempotency(idempotency_key)
        is_claimed = await self._redis.set(idem, spec.id, nx=True, ex=self._config.result_ttl_s)
        if not is_claimed:
            raw = await self._redis.get(idem)
            if raw is None:  # expired between SET and GET: nobody holds it now
                return await self.submit(body, idempotency_key)
            existing_id = as_bytes(raw).decode()
            status = as_optional_bytes(await self._redis.hget(self._keys.job(existing_id), F_STATUS))
            if status is None:
                raise IdempotencyInFlight(existing_id)
            return Admitted(existing_id, status.decode(), spec.lane.value, is_new=False)
        try:
            return await self._admit(spec)
        except BaseException:
            await self._release(keys=[idem], args=[spec.id])
            raise

    async def lane_depth(self, lane: Lane) -> int:
        """Jobs in a lane that are waiting or running.

        With Redis 7 the consumer group reports entries not yet delivered (`lag`) and
        delivered-but-unacknowledged ones (`pending`). Older servers have no lag; there
        the stream length is the depth because workers delete entries they acknowledge.
        """
        stream = self._keys.lane(lane)
        try:
            groups = await self._redis.xinfo_groups(stream)
        except aioredis.ResponseError:  # no stream yet
            return 0
        for group in groups:
            name = group.get("name")
            name = name.decode() if isinstance(name, bytes) else name
            if name == CONSUMER_GROUP and group.get("lag") is not None:
                return int(group["lag"]) + int(group.get("pending", 0))
        return int(await self._redis.xlen(stream))

    async def _admit(self, spec: JobSpec) -> Admitted:
        existing = as_optional_bytes(await self._redis.hget(self._keys.job(spec.id), F_STATUS))
        if existing is not None:
            return Admitted(spec.id, existing.decode(), spec.lane.value, is_new=False)
        max_depth = self._config.max_lane_depth[spec.lane.value]
        depth = await self.lane_depth(spec.lane)
        if depth >= max_depth:
            raise LaneFull(spec.lane, depth, max_depth)
        record = {
            F_ID: spec.id,
            F_STATUS: JobStatus.QUEUED.value,
            F_LANE: spec.lane.value,
            F_PRIORITY: str(spec.priority),
            F_CREATED_AT: repr(time.time()),
        }
        with self._enqueue_span(spec):
            args: list[str | bytes | int] = [self._config.result_ttl_s, DEFAULT_LANE_MAXLEN, spec.pack(), F_SPEC, spec.pack()]
            for name, value in record.items():
                args += [name, value]
            is_new, detail = await self._enqueue(keys=[self._keys.job(spec.id), self._keys.lane(spec.lane)], args=args)
        if not is_new:
            return Admitted(spec.id, detail.decode(), spec.lane.value, is_new=False)
        return Admitted(spec.id, JobStatus.QUEUED.value, spec.lane.value, is_new=True)
