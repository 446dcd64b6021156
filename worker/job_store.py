"""Every write a worker makes to a job record, each one atomic (a Lua script).

- ``start``: create the record of a directly XADDed job, drop entries whose job
  is already terminal (or running from another entry of the same id), spot a
  cancel flag or a passed deadline, else move the job to ``running`` (a
  reclaiming worker takes running -> running) and hand back its checkpoint.
- ``checkpoint``: store the output tokens so far, only while we still own it.
- ``commit``: the one place a job's outcome is written. The record is
  persisted first, then the final event, the reply entry, XACK + XDEL of the
  lane entry, the ``completed`` webhook delivery and the dead-letter entry —
  all in one script, so a dropped connection leaves either nothing (the entry
  stays pending and is redelivered) or all of it. Only the first terminal
  write wins; a loser publishes, replies and calls back nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from scheduler.protocol import job_record, state_machine
from scheduler.protocol.job import JobSpec, JobStatus, WebhookEvent, WebhookSpec
from scheduler.protocol.job_record import final_event, job_view, tenant_of_record
from scheduler.protocol.keys import CONSUMER_GROUP, DEFAULT_QUEUED_TTL_S, Keys
from scheduler.protocol.redis_replies import read_hash
from scheduler.protocol.state_machine import StartVerdict
from scheduler.protocol.webhooks import delivery_fields
from worker.job_trace import JobTrace

log = logging.getLogger(__name__)


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def pack_checkpoint(token_ids: list[int], logprobs: list[dict[str, Any]] | None, text: str | None = None,
                    prompt_tokens: int | None = None) -> bytes:
    """The output tokens so far, with their text and the prompt's length (kept on the record should the job
    fail before it ends); a job that asked for logprobs keeps theirs beside them, for its resume."""
    if logprobs is None and text is None and prompt_tokens is None:
        return pack(token_ids)
    data: dict[str, Any] = {"token_ids": token_ids}
    if logprobs is not None:
        data["logprobs"] = logprobs
    if text is not None:
        data["text"] = text
    if prompt_tokens is not None:
        data["prompt_tokens"] = prompt_tokens
    return pack(data)


def unpack_checkpoint(raw: bytes) -> tuple[list[int], list[dict[str, Any]] | None]:
    if not raw:
        return [], None
    data = msgpack.unpackb(raw)
    if isinstance(data, dict):
        logprobs = data.get("logprobs")
        return list(data["token_ids"]), None if logprobs is None else list(logprobs)
    return list(data), None


def checkpoint_outcome(raw: bytes | None,
                       finish_reason: str | None) -> tuple[dict[str, Any] | None, dict[str, int] | None]:
    """The output and usage of a job decided from its record alone: its checkpointed tokens, text and prompt
    length (``prompt_tokens`` 0 only for a checkpoint written before it was kept), or None for both."""
    if not raw:
        return None, None
    token_ids, logprobs = unpack_checkpoint(raw)
    data = msgpack.unpackb(raw)
    fields = data if isinstance(data, dict) else {}
    output: dict[str, Any] = {"text": fields.get("text"), "token_ids": token_ids, "finish_reason": finish_reason}
    if logprobs is not None:
        output["logprobs"] = logprobs
    usage = {"prompt_tokens": int(fields.get("prompt_tokens") or 0), "completion_tokens": len(token_ids),
             "cached_tokens": 0}
    return output, usage


@dataclass(frozen=True)
class EntryRef:
    """Where a job's message sits: its lane stream and entry id."""

    stream: str
    entry_id: str

    def __str__(self) -> str:
        return f"{self.stream} {self.entry_id}"


@dataclass
class JobStart:
    verdict: StartVerdict
    previous_status: str
    is_first_start: bool = False
    attempts: int = 0
    checkpoint: list[int] = field(default_factory=list)
    checkpoint_logprobs: list[dict[str, Any]] | None = None
    """The logprobs of the checkpoint's tokens, when the job asked for logprobs."""
    record: dict[bytes, bytes] = field(default_factory=dict)
    """The job record as the job starts (without the checkpoint), so its view needs no read."""


@dataclass
class Outcome:
    """A job's decided fate, ready to be committed once."""

    job_id: str
    status: JobStatus
    entry: EntryRef | None
    reply_to: str | None = None
    webhook: WebhookSpec | None = None
    output: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    first_token_at: float | None = None
    resumed_from: int | None = None
    dead_reason: str | None = None
    dead_payload: bytes | None = None
    """Original ``job`` field, copied to the dead-letter entry."""
    worker: str | None = None
    trace: JobTrace | None = None
    """The job's run here, when it ran here: closed with the job's spans and metrics."""
    traceparent: str | None = None
    """The job message's trace context: the parent of its webhook delivery when it did not run here."""
    is_new_record_only: bool = False
    """Write the outcome only if no record exists for the id (an invalid message must not decide a real job)."""
    lane: str | None = None
    created_at: float | None = None
    """The lane and enqueue time of a job whose record this outcome makes (no record held its id)."""
    tenant: str | None = None
    """The named tenant of a job whose record this outcome makes, so that the record is that tenant's."""
    is_refused: bool = False
    """The engine refused the job before it ran: its tenant's usage and tokens/min window count none of its
    tokens (the record's ``usage`` still gives the prompt's length)."""


class JobStore:
    """The worker's writes to job records, with the scripts registered once."""

    def __init__(self, client: aioredis.Redis, keys: Keys, *, worker: str, result_ttl_s: int,
                 reply_maxlen: int, dead_maxlen: int) -> None:
        self.client = client
        self.keys = keys
        self.worker = worker
        self.result_ttl_s = result_ttl_s
        self.reply_maxlen = reply_maxlen
        self.dead_maxlen = dead_maxlen
        self._start = client.register_script(state_machine.START)
        self._commit = client.register_script(state_machine.COMMIT)
        self._settle = client.register_script(state_machine.SETTLE_USAGE)

    async def start(self, spec: JobSpec, entry: EntryRef, created_at: float, now: float, start_token: str) -> JobStart:
        """Take the entry's job to running (`state_machine.START`); `start_token` names this admission, so that
        sending it again after a lost reply gets the same answer, not a second start."""
        assert start_token, "a START needs its admission's token"
        reply = await self._start(
            keys=[self.keys.job(spec.id), self.keys.cancel(spec.id)],
            args=[self.worker, repr(now), spec.pack(), spec.lane.value, spec.priority, repr(created_at), str(entry),
                  spec.id, "" if spec.deadline is None else repr(spec.deadline), start_token, DEFAULT_QUEUED_TTL_S],
        )
        verdict, previous = StartVerdict(_s(reply[0])), _s(reply[1]) if reply[1] else ""
        if verdict is not StartVerdict.RUN:
            return JobStart(verdict, previous)
        checkpoint, checkpoint_logprobs = unpack_checkpoint(reply[4])
        flat = reply[5]
        return JobStart(StartVerdict.RUN, previous, is_first_start=_s(reply[2]) == "1", attempts=int(reply[3]),
                         checkpoint=checkpoint, checkpoint_logprobs=checkpoint_logprobs,
                         record=dict(zip(flat[::2], flat[1::2])))

    async def commit(self, outcome: Outcome) -> bool:
        """Write the outcome if the job is not terminal yet; True when this call decided the job.

        Shielded, on every path that ends a job: once decided, a cancelled caller (a shutdown) does not
        cut the commit in half.
        """
        return await asyncio.shield(self._commit_outcome(outcome))

    async def _commit_outcome(self, outcome: Outcome) -> bool:
        now = time.time()
        job_key = self.keys.job(outcome.job_id)
        fields: dict[str, Any] = {job_record.F_FINISHED_AT: repr(now), job_record.F_WORKER: outcome.worker or self.worker}
        if outcome.output is not None:
            fields[job_record.F_OUTPUT] = pack(outcome.output)
        if outcome.usage is not None:
            fields[job_record.F_USAGE] = pack(outcome.usage)
        if outcome.error is not None:
            fields[job_record.F_ERROR] = pack(outcome.error)
        if outcome.resumed_from is not None:
            fields[job_record.F_RESUMED_FROM] = str(outcome.resumed_from)
        record = await read_hash(self.client, job_key)
        if outcome.first_token_at is not None and job_record.F_FIRST_TOKEN_AT.encode() not in record:
            fields[job_record.F_FIRST_TOKEN_AT] = repr(outcome.first_token_at)
        if job_record.F_ID.encode() not in record:
            fields[job_record.F_ID] = outcome.job_id
            if outcome.lane is not None:
                fields[job_record.F_LANE] = outcome.lane
            if outcome.created_at is not None:
                fields[job_record.F_CREATED_AT] = repr(outcome.created_at)
            if outcome.tenant is not None and job_record.F_SPEC.encode() not in record:
                fields[job_record.F_SPEC] = pack({"id": outcome.job_id, "tenant": outcome.tenant})
        merged = dict(record)
        merged.update({k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()})
        merged[job_record.F_STATUS.encode()] = outcome.status.value.encode()
        view = job_view(merged)
        final = pack(final_event(outcome.job_id, view, view["attempts"]))
        webhook: list[Any] = []
        if outcome.webhook is not None and outcome.webhook.wants(WebhookEvent.COMPLETED):
            traceparent = outcome.trace.traceparent if outcome.trace is not None else outcome.traceparent
            for k, v in delivery_fields(outcome.job_id, WebhookEvent.COMPLETED.value, outcome.webhook.url, view,
                                        traceparent=traceparent).items():
                webhook += [k, v]
        dead: list[Any] = []
        if outcome.dead_reason is not None:
            dead = ["reason", outcome.dead_reason, "job_id", outcome.job_id, "worker", self.worker]
            if outcome.entry is not None:
                dead += ["stream", outcome.entry.stream, "entry_id", outcome.entry.entry_id]
            if outcome.dead_payload is not None:
                dead += ["job", outcome.dead_payload]
        record_pairs: list[Any] = []
        for k, v in fields.items():
            record_pairs += [k, v]
        entry = outcome.entry
        # The gateway refuses reply streams inside carpool's prefix; one admitted before that gets no reply.
        reply_to = None if self.keys.check_reply_to(outcome.reply_to) else outcome.reply_to
        won, reply_type = await self._commit(
            keys=[job_key, entry.stream if entry else self.keys.dead, reply_to or self.keys.dead,
                  self.keys.webhooks, self.keys.dead],
            args=[outcome.status.value, CONSUMER_GROUP, entry.entry_id if entry else "",
                  self.keys.events(outcome.job_id), final, pack(view) if reply_to else "",
                  self.reply_maxlen, self.result_ttl_s, self.dead_maxlen, len(webhook) // 2, len(dead) // 2,
                  "1" if outcome.is_new_record_only else "", *webhook, *dead, *record_pairs],
        )
        if reply_type:
            log.warning("job %s: reply_to %r is a %s, not a stream: no reply was added", outcome.job_id,
                        outcome.reply_to, _s(reply_type))
        if won:
            await self.settle(outcome.job_id, tenant_of_record(merged), outcome.status,
                              None if outcome.is_refused else outcome.usage)
        return bool(won)

    async def settle(self, job_id: str, tenant: str, status: JobStatus | str, usage: dict[str, Any] | None) -> None:
        """Count a decided job in its tenant's usage and settle its tokens/min reservation (once per job)."""
        usage = usage or {}
        await self._settle(keys=[self.keys.job(job_id), self.keys.tenant_window(tenant), self.keys.tenant_usage(tenant)],
                           args=[JobStatus(status).value, int(usage.get("prompt_tokens", 0)),
                                 int(usage.get("completion_tokens", 0))])

    async def dead_letter_entry(self, entry: EntryRef, reason: str, raw_fields: dict[bytes, bytes],
                                job_id: str | None = None) -> None:
        """An entry whose job cannot be failed (no usable job id, or a record that takes no write): keep it on the
        dead stream, with its job's id when it has one, and let it go from the lane."""
        async with self.client.pipeline(transaction=True) as pipe:
            dead: dict[FieldT, EncodableT] = {
                b"reason": reason, b"stream": entry.stream, b"entry_id": entry.entry_id, b"worker": self.worker,
                **({b"job_id": job_id} if job_id is not None else {})}
            for k, v in raw_fields.items():
                # The entry's own fields are copied as they are; one named as one of carpool's is kept as `entry.NAME`,
                # so what a reader of the dead stream takes for the reason (a dict keeps one value a name) is carpool's.
                dead[b"entry." + k if k in dead else k] = v
            pipe.xadd(self.keys.dead, dead, maxlen=self.dead_maxlen, approximate=True)
            pipe.xack(entry.stream, CONSUMER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            await pipe.execute()

    async def ack(self, entry: EntryRef) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(entry.stream, CONSUMER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            await pipe.execute()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
