"""Cancelling a job from the gateway.

A queued job is cancelled on the spot (compare-and-set on its status), and
the gateway, having written the terminal status, also delivers it: the final
event, the reply stream entry and the webhook. A running job belongs to its
worker: the gateway raises the cancel flag and tells workers on the control
channel; the worker stops it at its next step and writes `cancelled` itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis

from gateway.results import final_event
from scheduler.job import F_ERROR, F_FINISHED_AT, F_SPEC, F_STATUS, JobSpec, JobStatus, WebhookEvent, job_view
from scheduler.keys import DEFAULT_REPLY_MAXLEN, Keys
from scheduler.redis_replies import read_hash
from scheduler.webhooks import delivery_fields, should_send

# Returns '+cancelled' or '+cancelling' when it acted, 'missing', or the terminal status it found.
# KEYS: job record, cancel flag. ARGV: now, packed error, flag ttl_s, control channel, packed control message.
_CANCEL_LUA = """
local status = redis.call('HGET', KEYS[1], '@status@')
if not status then return 'missing' end
if status == 'queued' then
  redis.call('HSET', KEYS[1], '@status@', 'cancelled', '@finished_at@', ARGV[1], '@error@', ARGV[2])
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  return '+cancelled'
end
if status == 'running' then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return '+cancelling'
end
return status
""".replace("@status@", F_STATUS).replace("@finished_at@", F_FINISHED_AT).replace("@error@", F_ERROR)


class JobNotFound(Exception):
    pass


class AlreadyFinished(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(f"job already {status}")
        self.status = status


@dataclass(frozen=True)
class CancelOutcome:
    view: dict[str, Any]
    is_cancelled_now: bool
    """True when the job was queued and is now cancelled; False when its worker was asked to stop."""


class Canceller:
    def __init__(self, redis: aioredis.Redis, keys: Keys, flag_ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._flag_ttl_s = flag_ttl_s
        self._cancel = redis.register_script(_CANCEL_LUA)

    async def cancel(self, job_id: str) -> CancelOutcome:
        error = msgpack.packb({"type": "cancelled", "message": "cancelled before it started"})
        control = msgpack.packb({"type": "cancel", "id": job_id})
        outcome = (
            await self._cancel(
                keys=[self._keys.job(job_id), self._keys.cancel(job_id)],
                args=[repr(time.time()), error, self._flag_ttl_s, self._keys.control, control],
            )
        ).decode()
        if outcome == "missing":
            raise JobNotFound(job_id)
        if outcome not in ("+cancelled", "+cancelling"):
            raise AlreadyFinished(outcome)
        record = await read_hash(self._redis, self._keys.job(job_id))
        if outcome == "+cancelling":
            return CancelOutcome(job_view(record), is_cancelled_now=False)
        assert record.get(F_STATUS.encode()) == JobStatus.CANCELLED.value.encode()
        await self._deliver(record)
        return CancelOutcome(job_view(record), is_cancelled_now=True)

    async def _deliver(self, record: dict[bytes, bytes]) -> None:
        """Result written first, then published, replied and called back (same order as the worker)."""
        view = job_view(record)
        spec = JobSpec.unpack(record[F_SPEC.encode()])
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.publish(self._keys.events(spec.id), msgpack.packb(final_event(record)))
            if spec.reply_to:
                pipe.xadd(spec.reply_to, {"result": msgpack.packb(view)}, maxlen=DEFAULT_REPLY_MAXLEN, approximate=True)
            if spec.webhook is not None and should_send(spec.webhook.events, WebhookEvent.COMPLETED):
                fields = delivery_fields(spec.id, WebhookEvent.COMPLETED, spec.webhook.url, view,
                                         traceparent=spec.traceparent)
                pipe.xadd(self._keys.webhooks, fields)
            await pipe.execute()
