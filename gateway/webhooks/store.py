"""Webhook delivery state in Redis, changed only by the atomic scripts of ``scheduler.protocol.state_machine``:
ingest, claim, settle, release.

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

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from scheduler.protocol import state_machine
from scheduler.protocol.keys import DEFAULT_DEAD_MAXLEN, WEBHOOK_GROUP, Keys
from scheduler.protocol.redis_client import ensure_group
from scheduler.protocol.redis_replies import as_bytes, bytes_hash
from scheduler.protocol.webhooks import AttemptOutcome, AttemptRecord, Decision

log = logging.getLogger(__name__)


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
        self._ingest = redis.register_script(state_machine.WEBHOOK_INGEST)
        self._claim = redis.register_script(state_machine.WEBHOOK_CLAIM)
        self._settle = redis.register_script(state_machine.WEBHOOK_SETTLE)
        self._release = redis.register_script(state_machine.WEBHOOK_RELEASE)
        self._replay = redis.register_script(state_machine.WEBHOOK_REPLAY)

    async def ensure_group(self) -> None:
        # From id 0: entries XADDed before any dispatcher ever ran are delivered too.
        await ensure_group(self._redis, self._keys.webhooks, WEBHOOK_GROUP)

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
        claimed = []
        for row in rows:
            try:
                claimed.append(Claimed(
                    delivery_id=row[0].decode(), attempt=int(row[1]), job_id=row[2].decode(), event=row[3].decode(),
                    url=row[4].decode(), payload=bytes(row[5]), token=token, traceparent=row[6].decode() or None,
                ))
            except UnicodeDecodeError:  # stored before ingest refused such fields: it must not cost the rest
                await self._drop_unreadable(row, token, now)
        return claimed

    async def _drop_unreadable(self, row: list[bytes], token: str, now: float) -> None:
        """Dead-letter a claimed delivery whose id, job id, event, URL or trace context is not UTF-8 text: it could
        never be sent, and as its job's chain head it would hold back the job's later deliveries. Its keys are
        built from the stored bytes, so the one settle script ends it and moves the chain on."""
        k, (raw_id, raw_job) = self._keys, (bytes(row[0]), bytes(row[2]))
        reason = "invalid webhook delivery: a field is not UTF-8 text"
        log.error("webhook delivery %r of job %r: %s; dead-lettered", raw_id, raw_job, reason)
        record = AttemptRecord(delivery_id=raw_id.decode(errors="replace"), event=bytes(row[3]).decode(errors="replace"),
                               attempt=int(row[1]), at=now, status_code=None, error=reason, next_at=None,
                               outcome=AttemptOutcome.DEAD.value)
        await self._settle(
            keys=[k.webhook_delivery("").encode() + raw_id, k.webhooks_retry, k.job("").encode() + raw_job,
                  k.webhook_chain("").encode() + raw_job, k.webhooks_dead],
            args=[raw_id, token, AttemptOutcome.DEAD.value, repr(0.0), record.pack(), repr(now), self._ttl_s,
                  self._dead_maxlen, reason, k.webhook_delivery("")],
        )

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

    async def replay_dead(self, delivery_ids: set[str] | None, *, now: float) -> list[str]:
        """Put the dead-lettered deliveries named (None: every one) back on the webhook stream, each under its
        own id; the ids moved, in the dead stream's order. Entries that record a malformed stream entry, not a
        delivery, stay."""
        k = self._keys
        moved: list[str] = []
        cursor = "-"
        while True:
            page = [(as_bytes(entry_id), bytes_hash(fields or {}))
                    for entry_id, fields in await self._redis.xrange(k.webhooks_dead, min=cursor, count=500) or []
                    if entry_id is not None]
            for entry_id, fields in page:
                raw_id = fields.get(b"id")
                delivery_id = None if raw_id is None else raw_id.decode(errors="replace")
                if delivery_id is None or (delivery_ids is not None and delivery_id not in delivery_ids):
                    continue
                if await self._replay(keys=[k.webhooks, k.webhooks_dead],
                                      args=[entry_id, repr(now), k.webhook_delivery("")]):
                    moved.append(delivery_id)
            if len(page) < 500:
                return moved
            cursor = "(" + page[-1][0].decode()

    async def release(self, claimed: Claimed, *, now: float) -> bool:
        """Hand an unfinished attempt back so the next dispatcher poll retries it at once."""
        k = self._keys
        return bool(await self._release(
            keys=[k.webhook_delivery(claimed.delivery_id), k.webhooks_retry],
            args=[claimed.delivery_id, claimed.token, repr(now)],
        ))
