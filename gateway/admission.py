"""Admission: decide whether a submitted job enters a lane, then enqueue it atomically.

Order of checks: the body must validate into a `JobSpec` (400 naming the
field); its deadline must lie ahead and its token-id prompt must fit the
model (400); a repeated `Idempotency-Key` or job id returns the job that
already exists (nothing enqueued twice); a lane at its maximum depth, or a
tenant at its maximum of queued jobs, refuses with 429. The body never names
the tenant: the caller's is written into the message. Idempotency keys and job
ids are the tenant's own: another tenant's key is another key, and a job id
that another tenant's job holds is refused without saying anything of that
job. The idempotency key's claim, the lane's and the tenant's counts, the
record and the lane entry are one atomic script, so a crash anywhere leaves
either all of them or none, and requests admitted at once cannot together
take a lane past its maximum depth.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.api_keys import OPEN_CALLER, Caller
from gateway.config import GatewayConfig
from gateway.model_limits import ModelLimits
from gateway.rate_limits import Reservation
from scheduler.protocol import state_machine
from scheduler.protocol.job import JobSpec, JobStatus, JobValidationError, new_job_id
from scheduler.protocol.job_record import (
    F_CREATED_AT, F_ID, F_LANE, F_PRIORITY, F_RESERVATION, F_SPEC, F_STATUS, tenant_of_record,
)
from scheduler.protocol.keys import CONSUMER_GROUP, WAKE_MAXLEN, Keys
from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.redis_replies import as_bytes, as_optional_bytes
from scheduler.protocol.tenants import DEFAULT_TENANT

MAX_IDEMPOTENCY_KEY_LEN = 255

WebhookCheck = Callable[[str], Awaitable[None]]
"""Raises ValueError (with a reason) when a webhook URL may not be used; may resolve the host."""

# (spec, linked): the span around enqueuing a job; `linked` is the traceparent of the work that made it, when
# that is not its parent (a Batch API line links to the request that created its batch).
EnqueueSpan = Callable[[JobSpec, str | None], AbstractContextManager[Callable[[str], None]]]
"""Wraps the enqueue in a trace span and sets the spec's ``traceparent`` before it is packed; yields what takes the
enqueue script's verdict for the span (`enqueued`, a repeat, or a refusal)."""


MAX_CLAIM_TRIES = 3
"""Tries to admit past keys that name expired jobs before a request is told another one holds its key."""


class InvalidJob(Exception):
    def __init__(self, field: str, message: str, *, is_context_exceeded: bool = False) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.is_context_exceeded = is_context_exceeded
        """The prompt, or the prompt with max_tokens, does not fit the model's context."""


def check_vocabulary(spec: JobSpec, vocab_size: int) -> None:
    """Refuse prompt token ids the model has no embedding for (the worker would fail the job), and stop token ids
    it can never generate (the job would run as if they were not given)."""
    for name, ids, why in (("prompt_token_ids", spec.prompt_token_ids or (), ""),
                           ("params.stop_token_ids", spec.params.stop_token_ids, ": it is never generated")):
        for i, token_id in enumerate(ids):
            if token_id >= vocab_size:
                raise InvalidJob(name, f"token id {token_id} (at {i}) is outside the model's vocabulary "
                                       f"(0..{vocab_size - 1}){why}")


def check_fits(spec: JobSpec, max_len: int) -> None:
    """Refuse a job whose prompt + max_tokens cannot fit the model's context, naming the field at fault.

    A string prompt's token count is unknown until the worker tokenizes it, and a token can span many
    bytes, so no byte count proves it too long: the worker judges those (and fails them naming `prompt`).
    """
    max_tokens = spec.params.max_tokens
    if spec.prompt_token_ids is not None:
        num_prompt = len(spec.prompt_token_ids)
        if num_prompt >= max_len:
            raise InvalidJob("prompt_token_ids",
                             f"{num_prompt} tokens leave no room to generate within the model's context of {max_len}",
                             is_context_exceeded=True)
        if max_tokens is not None and num_prompt + max_tokens > max_len:
            raise InvalidJob("params.max_tokens", f"the prompt's {num_prompt} tokens + {max_tokens} exceed the "
                                                  f"model's context of {max_len}; at most {max_len - num_prompt}",
                             is_context_exceeded=True)
    # No prompt leaves room for these (a prompt has a token at least), whatever it is: the context is exceeded.
    if max_tokens is not None and max_tokens >= max_len:
        raise InvalidJob("params.max_tokens", f"must be below the model's context length of {max_len}",
                         is_context_exceeded=True)
    if spec.params.min_tokens >= max_len:  # with max_tokens left out too
        raise InvalidJob("params.min_tokens", f"must be below the model's context length of {max_len}",
                         is_context_exceeded=True)


class JobIdTaken(InvalidJob):
    """The job id names another tenant's job, which this caller may neither see nor take over."""

    def __init__(self, job_id: str) -> None:
        super().__init__("id", f"{job_id!r} is taken; choose another id, or leave it out to get a fresh one")
        self.job_id = job_id


class LaneFull(Exception):
    def __init__(self, lane: Lane, depth: int, max_depth: int, num_needed: int = 1) -> None:
        room = f"lane {lane.value} is full" if num_needed == 1 else f"lane {lane.value} has no room for {num_needed} jobs"
        super().__init__(f"{room} ({depth} {'job' if depth == 1 else 'jobs'}, at most {max_depth})")
        self.lane = lane


class QuotaExceeded(Exception):
    """The tenant already has its maximum of jobs waiting or running."""

    def __init__(self, tenant: str, queued: int, max_queued: int, num_needed: int = 1) -> None:
        needs = f"; this request needs room for {num_needed}" if num_needed > 1 else ""
        super().__init__(f"tenant {tenant!r} has {queued} jobs queued or running, its maximum is {max_queued}{needs}")
        self.tenant = tenant
        self.max_queued = max_queued


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
        enqueue_span: EnqueueSpan = lambda spec, linked: nullcontext(lambda verdict: None),
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._config = config
        self._limits = ModelLimits(redis, keys, config.max_model_len, config.model_heartbeat_max_age_s)
        self._check_webhook = check_webhook
        self._enqueue_span = enqueue_span
        self._enqueue = redis.register_script(state_machine.ENQUEUE)
        self._release = redis.register_script(state_machine.RELEASE_KEY)

    async def validate(self, body: object, caller: Caller = OPEN_CALLER, *, batch_results: str | None = None) -> JobSpec:
        """The body as a job of `caller`'s tenant; raises InvalidJob naming the field at fault.

        `batch_results`: the one key of carpool's own the job may reply to, given by the Batch API's driver for its
        batch's jobs; no other job may name a batch's results stream, where it could add a result to a batch."""
        default_id = new_job_id()
        if isinstance(body, dict) and "tenant" in body:
            raise InvalidJob("tenant", "is set by the gateway from the API key; leave it out")
        try:
            spec = dataclasses.replace(JobSpec.from_wire(body, default_id=default_id), tenant=caller.tenant)
        except JobValidationError as e:
            raise InvalidJob(e.field, e.message) from e
        if spec.deadline is not None and spec.deadline <= time.time():
            raise InvalidJob("deadline", "already passed")
        limits = await self._limits.get()
        if limits.max_model_len is not None:
            check_fits(spec, limits.max_model_len)
        if limits.vocab_size is not None:
            check_vocabulary(spec, limits.vocab_size)
        reply_problem = None if spec.reply_to == batch_results else self._keys.check_reply_to(
            spec.reply_to, may_name_batch_results=False)
        if reply_problem is None and spec.reply_to is not None and spec.reply_to != batch_results:
            reply_problem = tenant_reply_problem(spec.reply_to, spec.tenant)
        if reply_problem is not None:
            raise InvalidJob("reply_to", reply_problem)
        if spec.webhook is not None:
            await self.check_webhook_url(spec.webhook.url)
        return spec

    async def check_webhook_url(self, url: str) -> None:
        """Refuse a webhook URL this server may not call (or cannot sign for), as ``webhook.url``."""
        if self._check_webhook is not None:
            try:
                await self._check_webhook(url)
            except ValueError as e:
                raise InvalidJob("webhook.url", str(e).removeprefix("webhook.url: ")) from e

    async def context_length(self) -> int | None:
        """The model's context as admission judges it (`--max-model-len`, else learned); None before any worker."""
        return (await self._limits.get()).max_model_len

    async def submit(self, body: object, idempotency_key: str | None, *, caller: Caller = OPEN_CALLER,
                     reservation: Reservation | None = None, num_following: int = 0,
                     batch_results: str | None = None, linked_trace: str | None = None) -> Admitted:
        """Validate and enqueue a job of `caller`'s tenant (see `enqueue`, and `validate` for `batch_results`)."""
        return await self.enqueue(await self.validate(body, caller, batch_results=batch_results), idempotency_key,
                                  caller=caller, reservation=reservation, num_following=num_following,
                                  linked_trace=linked_trace, is_batch_line=batch_results is not None)

    async def find(self, spec: JobSpec, idempotency_key: str | None) -> Admitted | None:
        """The job of the spec's tenant that `enqueue` would answer with instead of enqueuing (what the
        Idempotency-Key names, else the job with the spec's id), or None; read without writing, so a retry
        is answered before it counts against any limit. Raises JobIdTaken, or InvalidJob for a bad key."""
        idem = self._idempotency(spec, idempotency_key)
        owner = None if idem is None else as_optional_bytes(await self._redis.get(idem))
        if owner is not None:
            status, tenant = await self._status_of(owner.decode())
            if status is not None and tenant == spec.tenant:
                return Admitted(owner.decode(), status, spec.lane.value, is_new=False)
        status, tenant = await self._status_of(spec.id)
        if status is None:
            return None
        if tenant != spec.tenant:
            raise JobIdTaken(spec.id)
        return Admitted(spec.id, status, spec.lane.value, is_new=False)

    async def enqueue(self, spec: JobSpec, idempotency_key: str | None, *, caller: Caller = OPEN_CALLER,
                      reservation: Reservation | None = None, num_following: int = 0,
                      linked_trace: str | None = None, is_batch_line: bool = False) -> Admitted:
        """Enqueue a validated job; `reservation`: the tokens/min this job holds, settled when it ends;
        `num_following`: jobs of the same request enqueued next, which the lane and the tenant's quota must
        have room for too; `linked_trace`: see `EnqueueSpan`; `is_batch_line`: a Batch API line, which the
        tenant's `max_queued` does not hold back and which counts apart from its other jobs.
        Raises LaneFull, QuotaExceeded, IdempotencyInFlight, JobIdTaken, or InvalidJob for a bad Idempotency-Key."""
        idem = self._idempotency(spec, idempotency_key)
        for _ in range(MAX_CLAIM_TRIES):
            verdict, detail = await self._enqueue_once(spec, idem, caller, reservation, num_following, linked_trace,
                                                       is_batch_line)
            if verdict == "enqueued":
                return Admitted(spec.id, JobStatus.QUEUED.value, spec.lane.value, is_new=True)
            if verdict == "exists":
                return Admitted(spec.id, detail, spec.lane.value, is_new=False)
            if verdict == "taken":
                raise JobIdTaken(spec.id)
            assert verdict == "claimed" and idem is not None, verdict
            status, tenant = await self._status_of(detail)
            if status is not None and tenant == spec.tenant:
                return Admitted(detail, status, spec.lane.value, is_new=False)
            # The key outlived its job's record (deleted, or expired first, its id perhaps another tenant's
            # since): it names nothing of this tenant's, so let it go.
            await self._release(keys=[idem], args=[detail])
        raise IdempotencyInFlight(detail)

    def _idempotency(self, spec: JobSpec, idempotency_key: str | None) -> str | None:
        """The Redis key of the spec's tenant's Idempotency-Key; raises InvalidJob for a malformed one."""
        if idempotency_key is None:
            return None
        if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LEN or not idempotency_key.isprintable():
            raise InvalidJob("Idempotency-Key", f"must be 1..{MAX_IDEMPOTENCY_KEY_LEN} printable characters")
        return self._keys.idempotency(spec.tenant, idempotency_key)

    async def _status_of(self, job_id: str) -> tuple[str | None, str]:
        """A job's status (None when it has no record) and tenant."""
        status, packed = await self._redis.hmget(self._keys.job(job_id), [F_STATUS, F_SPEC])
        record = {} if packed is None else {F_SPEC.encode(): as_bytes(packed)}
        return None if status is None else as_bytes(status).decode(), tenant_of_record(record)

    async def _enqueue_once(self, spec: JobSpec, idem: str | None, caller: Caller,
                            reservation: Reservation | None, num_following: int,
                            linked_trace: str | None, is_batch_line: bool) -> tuple[str, str]:
        """Run the enqueue script once: (verdict, detail) as it returns them; raises LaneFull, QuotaExceeded."""
        max_depth = self._config.max_lane_depth[spec.lane.value]
        record = {
            F_ID: spec.id,
            F_STATUS: JobStatus.QUEUED.value,
            F_LANE: spec.lane.value,
            F_PRIORITY: str(spec.priority),
            F_CREATED_AT: repr(time.time()),
        }
        if reservation is not None:
            record[F_RESERVATION] = reservation.field_value
        job_key = self._keys.job(spec.id)
        with self._enqueue_span(spec, linked_trace) as say_verdict:
            packed = spec.pack()
            named = spec.tenant != DEFAULT_TENANT
            max_queued = caller.limits.max_queued
            args: list[str | bytes | int] = [
                self._config.queued_ttl_s, max_depth, "1" if idem is not None else "", spec.id, packed,
                spec.tenant if named else "", "" if max_queued is None or not named else max_queued, CONSUMER_GROUP,
                # A request's choices are all admitted or none: the first needs room for those that follow it.
                WAKE_MAXLEN, 1 + num_following, "1" if is_batch_line else "", self._keys.tenant_lane_prefix(spec.lane),
                F_SPEC, packed,
            ]
            for name, value in record.items():
                args += [name, value]
            tenant_streams = [self._keys.tenant_lane(lane, spec.tenant) for lane in LANES] if named else []
            reply = await self._enqueue(keys=[
                job_key, self._keys.tenant_lane(spec.lane, spec.tenant), idem or job_key,
                self._keys.lane_tenants(spec.lane), self._keys.wake, self._keys.tenant_batch_lines(spec.tenant),
                self._keys.lane(spec.lane), *tenant_streams], args=args)
            verdict = as_bytes(reply[0]).decode()
            say_verdict(verdict)
        if verdict == "full":
            raise LaneFull(spec.lane, int(as_bytes(reply[1])), max_depth, 1 + num_following)
        if verdict == "quota":
            assert max_queued is not None
            raise QuotaExceeded(spec.tenant, int(as_bytes(reply[1])), max_queued, 1 + num_following)
        return verdict, "" if len(reply) < 2 else as_bytes(reply[1]).decode()


def tenant_reply_problem(reply_to: str, tenant: str) -> str | None:
    """Why a tenant's job may not reply to `reply_to`, or None. A named tenant (API keys on) replies only to
    streams under its own name (``acme:results``): it cannot add entries to another tenant's reply stream, trim
    it (a stream is capped at ``--reply-maxlen``), or write into any other key of the Redis. Tenant names hold
    no ``:``, so ``acme:`` is acme's alone. The default tenant (no keys) may name any stream outside carpool's."""
    if tenant == DEFAULT_TENANT or reply_to.startswith(f"{tenant}:"):
        return None
    return (f"a stream of tenant {tenant!r} must start with {tenant + ':'!r} (for example {tenant + ':results'!r}), "
            "so that no tenant writes into another's streams")
