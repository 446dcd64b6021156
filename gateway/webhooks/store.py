"""Webhook delivery state in Redis, changed only by three atomic scripts: ingest, claim, settle.

A delivery is a hash (``keys.webhook_delivery(id)``) holding the exact body to
send. One job's deliveries queue on its chain (``keys.webhook_chain(job)``)
and only the chain's head is ever scheduled, so a receiver sees ``started``,
then the ``output``s, then ``completed``. The retry ZSET holds the head's due
time; claiming an attempt moves that time forward by a lease instead of
removing the entry, so a dispatcher that dies mid-attempt leaves the delivery
to be retried when the lease runs out, and two dispatchers never hold the
same attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from scheduler.protocol.keys import DEFAULT_DEAD_MAXLEN, WEBHOOK_GROUP, Keys
from scheduler.protocol.webhooks import AttemptOutcome, AttemptRecord, Decision

F_GONE = "wh_gone"
"""Job record field set when a receiver answered 410: the job's later events are not sent."""

# KEYS: webhook stream, retry zset, webhook dead stream.
# ARGV: group, consumer, count, now, ttl_s, delivery key prefix, chain key prefix, job key prefix, dead maxlen.
_INGEST = """
local entries = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if not entries then return 0 end
local n = 0
for _, entry in ipairs(entries[1][2]) do
  local eid, flat, f = entry[1], entry[2], {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  local missing = nil
  for _, name in ipairs({'id', 'job_id', 'event', 'url', 'payload'}) do
    if not f[name] or f[name] == '' then missing = name break end
  end
  if missing then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[9], '*', 'entry', eid, 'at', ARGV[4],
      'reason', 'invalid webhook delivery entry: missing field ' .. missing)
  else
    local dkey = ARGV[6] .. f['id']
    -- A delivery id seen before is the same delivery (a producer retrying its XADD).
    if redis.call('EXISTS', dkey) == 0 then
      redis.call('HSET', dkey, 'id', f['id'], 'job_id', f['job_id'], 'event', f['event'], 'url', f['url'],
        'payload', f['payload'], 'created_at', f['created_at'] or ARGV[4], 'attempts', 0, 'state', 'pending',
        'traceparent', f['traceparent'] or '')
      if redis.call('HEXISTS', ARGV[8] .. f['job_id'], '""" + F_GONE + """') == 1 then
        redis.call('HSET', dkey, 'state', 'gone')
        redis.call('EXPIRE', dkey, ARGV[5])
      else
        local chain = ARGV[7] .. f['job_id']
        local len = redis.call('RPUSH', chain, f['id'])
        redis.call('EXPIRE', chain, ARGV[5])
        if len == 1 then redis.call('ZADD', KEYS[2], ARGV[4], f['id']) end
      end
      n = n + 1
    end
  end
  redis.call('XACK', KEYS[1], ARGV[1], eid)
  redis.call('XDEL', KEYS[1], eid)
end
return n
"""

# KEYS: retry zset.  ARGV: now, lease until, limit, delivery key prefix, claim token.
_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
local out = {}
for _, id in ipairs(ids) do
  local dkey = ARGV[4] .. id
  if redis.call('EXISTS', dkey) == 0 then
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    redis.call('HSET', dkey, 'claim', ARGV[5], 'state', 'sending')
    local attempt = redis.call('HINCRBY', dkey, 'attempts', 1)
    local d = redis.call('HMGET', dkey, 'job_id', 'event', 'url', 'payload', 'traceparent')
    table.insert(out, {id, attempt, d[1], d[2], d[3], d[4], d[5] or ''})
  end
end
return out
"""

# KEYS: delivery, retry zset, job record, chain, webhook dead stream.
# ARGV: id, claim token, outcome, next_at, packed attempt record, now, ttl_s, dead maxlen, reason, delivery key prefix.
_SETTLE = """
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[2] then return 0 end
local outcome = ARGV[3]
redis.call('HDEL', KEYS[1], 'claim')
redis.call('HSET', KEYS[1], 'state', outcome, 'last_at', ARGV[6])
local has_job = redis.call('EXISTS', KEYS[3]) == 1
if has_job then
  local n = redis.call('HINCRBY', KEYS[3], 'wh_count', 1)
  redis.call('HSET', KEYS[3], 'wh:' .. n, ARGV[5])
end
if outcome == 'retrying' then
  redis.call('HSET', KEYS[1], 'next_at', ARGV[4])
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  return 1
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'next_at')
redis.call('EXPIRE', KEYS[1], ARGV[7])
if outcome == 'dead' then
  local d = redis.call('HMGET', KEYS[1], 'job_id', 'event', 'url', 'attempts', 'payload')
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[8], '*', 'id', ARGV[1], 'job_id', d[1], 'event', d[2],
    'url', d[3], 'attempts', d[4], 'reason', ARGV[9], 'at', ARGV[6], 'payload', d[5])
end
local gone = outcome == 'gone'
if gone and has_job then redis.call('HSET', KEYS[3], '""" + F_GONE + """', ARGV[1]) end
redis.call('LREM', KEYS[4], 1, ARGV[1])
while true do
  local nxt = redis.call('LINDEX', KEYS[4], 0)
  if not nxt then break end
  if not gone then
    redis.call('ZADD', KEYS[2], ARGV[6], nxt)
    break
  end
  redis.call('LPOP', KEYS[4])
  redis.call('HSET', ARGV[10] .. nxt, 'state', 'gone')
  redis.call('EXPIRE', ARGV[10] .. nxt, ARGV[7])
end
return 1
"""

# KEYS: delivery, retry zset.  ARGV: id, claim token, now.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], 'claim')
redis.call('HSET', KEYS[1], 'state', 'pending')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class Claimed:
    """One attempt a dispatcher holds: the delivery as stored, plus the claim that proves it holds it."""

    delivery_id: str
    attempt: int
    job_id: str
    event: str
    url: str
    payload: bytes
    token: str
    traceparent: str | None = None
    """The job's trace context, when its producer gave one: the attempt's span joins that trace."""


class DeliveryStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int, dead_maxlen: int = DEFAULT_DEAD_MAXLEN) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_s = ttl_s
        self._dead_maxlen = dead_maxlen
        self._ingest = redis.register_script(_INGEST)
        self._claim = redis.register_script(_CLAIM)
        self._settle = redis.register_script(_SETTLE)
        self._release = redis.register_script(_RELEASE)

    async def ensure_group(self) -> None:
        # From id 0: entries XADDed before any dispatcher ever ran are delivered too.
        try:
            await self._redis.xgroup_create(self._keys.webhooks, WEBHOOK_GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def ingest(self, consumer: str, *, count: int, now: float) -> int:
        """Move new stream entries into delivery hashes and job chains; returns how many were new."""
        k = self._keys
        return int(await self._ingest(
            keys=[k.webhooks, k.webhooks_retry, k.webhooks_dead],
            args=[WEBHOOK_GROUP, consumer, count, repr(now), self._ttl_s, k.webhook_delivery(""),
                  k.webhook_chain(""), k.job(""), self._dead_maxlen],
        ))

    async def claim(self, *, now: float, lease_until: float, limit: int, token: str) -> list[Claimed]:
        k = self._keys
        rows = await self._claim(
            keys=[k.webhooks_retry], args=[repr(now), repr(lease_until), limit, k.webhook_delivery(""), token]
        )
        return [
            Claimed(
                delivery_id=row[0].decode(), attempt=int(row[1]), job_id=row[2].decode(), event=row[3].decode(),
                url=row[4].decode(), payload=bytes(row[5]), token=token, traceparent=row[6].decode() or None,
            )
            for row in rows
        ]

    async def settle(self, claimed: Claimed, decision: Decision, record: AttemptRecord, *, now: float) -> bool:
        """Record the attempt and act on its outcome; False when this dispatcher's claim had lapsed."""
        k = self._keys
        next_at = record.next_at if decision.outcome is AttemptOutcome.RETRYING else None
        return bool(await self._settle(
            keys=[k.webhook_delivery(claimed.delivery_id), k.webhooks_retry, k.job(claimed.job_id),
                  k.webhook_chain(claimed.job_id), k.webhooks_dead],
            args=[claimed.delivery_id, claimed.token, decision.outcome.value, repr(next_at or 0.0), record.pack(),
                  repr(now), self._ttl_s, self._dead_maxlen, decision.reason or "", k.webhook_delivery("")],
        ))

    async def release(self, claimed: Claimed, *, now: float) -> bool:
        """Hand an unfinished attempt back so the next dispatcher poll retries it at once."""
        k = self._keys
        return bool(await self._release(
            keys=[k.webhook_delivery(claimed.delivery_id), k.webhooks_retry],
            args=[claimed.delivery_id, claimed.token, repr(now)],
        ))
