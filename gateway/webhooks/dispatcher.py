"""The webhook dispatcher: takes deliveries off ``keys.webhooks``, signs and sends them, retries on schedule.

Run it in-process (`async with WebhookDispatcher(redis, keys, config): ...`,
which is how the gateway hosts it) or on its own with ``carpool webhooks``
(`gateway.webhooks.cli`).
Several dispatchers may share one Redis: every state change is one atomic
script in `gateway.webhooks.store`, so no attempt is sent twice by two of
them, and all state lives in Redis, so a restarted dispatcher carries on
where the old one stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import aiohttp
import redis.asyncio as aioredis
import redis.exceptions
from opentelemetry.trace import Span, Status, StatusCode

from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.safety import VettingResolver, WebhookUrlError, check_webhook_url
from gateway.webhooks.signing import signed_headers
from gateway.webhooks.store import Claimed, DeliveryStore
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_client import is_out_of_memory
from scheduler.protocol.redis_replies import REDIS_UNAVAILABLE
from scheduler.protocol.webhooks import AttemptOutcome, AttemptRecord, decide, parse_retry_after
from scheduler.runtime.outage_log import OutageLog, describe
from scheduler.telemetry.log_format import job_context

log = logging.getLogger(__name__)

USER_AGENT = "carpool-webhooks/0.1"
LEASE_MARGIN_S = 5.0
"""A claimed attempt comes due again this long after its timeout, in case its dispatcher died."""
INGEST_BATCH = 100
REDIS_RETRY_S = 1.0
"""How long the loop waits after a round that failed (Redis unavailable, or anything else) before the next."""


@dataclass(frozen=True)
class Sent:
    """What one POST came to: an HTTP answer, or an error; `is_refused` when the URL itself was refused."""

    status_code: int | None
    error: str | None
    retry_after_s: float | None = None
    is_refused: bool = False


class AttemptObserver(Protocol):
    """Where attempt counts, durations and spans go (``gateway.webhooks.metrics.WebhookMetrics`` implements it)."""

    def webhook_attempt(self, event: str, outcome: str, duration_s: float | None = None) -> None: ...

    def webhook_span(self, traceparent: str | None, event: str, url: str) -> AbstractContextManager[Span]: ...


class WebhookDispatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        config: WebhookConfig,
        *,
        name: str | None = None,
        observer: AttemptObserver | None = None,
    ) -> None:
        self._config = config
        self._observer = observer
        self._store = DeliveryStore(redis, keys, ttl_s=config.webhook_ttl_s)
        self._policy = config.retry_policy()
        self._allow = config.allowlist()
        self._key = config.signing_key()
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._rand = random.Random()
        self._attempts: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._is_stopping = False
        self._task: asyncio.Task[None] | None = None
        self._outages = OutageLog(log, retry_s=REDIS_RETRY_S)

    async def __aenter__(self) -> WebhookDispatcher:
        self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The delivery loop's task once started (done when the loop ended, for whatever reason)."""
        return self._task

    def start(self) -> None:
        assert self._task is None, "dispatcher already started"
        self._task = asyncio.create_task(self.run(), name=f"webhook-dispatcher-{self.name}")

    async def close(self) -> None:
        """Stop taking attempts, let in-flight ones finish within ``webhook_drain_s``, then cancel the rest."""
        self._is_stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task  # re-raises whatever ended the loop, so it is never lost

    async def run(self) -> None:
        if self._key is None:
            log.warning("no --webhook-secret configured: webhook deliveries stay queued until a dispatcher with one runs")
            return
        connector = aiohttp.TCPConnector(
            resolver=VettingResolver(self._allow), use_dns_cache=False, limit=self._config.webhook_concurrency
        )
        timeout = aiohttp.ClientTimeout(total=self._config.webhook_timeout_s)
        # trust_env=False: proxy variables must not route webhooks around the address checks.
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            try:
                is_grouped = False
                while not self._is_stopping:
                    try:
                        if not is_grouped:
                            await self._store.ensure_group()
                            is_grouped = True
                        is_busy = await self._step(session)
                    except Exception as e:
                        if isinstance(e, redis.exceptions.ResponseError) and "NOGROUP" in str(e):
                            is_grouped = False  # the stream was deleted under us: recreate the group
                            continue
                        if is_redis_unavailable(e):
                            self._outages.warn("webhook dispatcher", e)
                        else:
                            # Whatever went wrong, deliveries keep their state in Redis: the next round retries.
                            log.exception("webhook dispatcher: a round failed; retrying in %.0f s", REDIS_RETRY_S)
                        await self._sleep(REDIS_RETRY_S)
                        continue
                    self._outages.recovered()
                    if not is_busy:
                        await self._sleep(self._config.webhook_poll_s)
            finally:
                await self._drain()

    async def _sleep(self, delay_s: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=delay_s)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _step(self, session: aiohttp.ClientSession) -> bool:
        """Ingest new deliveries and start due attempts; True when there may be more to do right away."""
        now = time.time()
        num_new = await self._store.ingest(self.name, count=INGEST_BATCH, now=now)
        free = self._config.webhook_concurrency - len(self._attempts)
        if free <= 0:
            return False
        claimed = await self._store.claim(
            now=now,
            lease_until=now + self._config.webhook_timeout_s + LEASE_MARGIN_S,
            limit=free,
            token=f"{self.name}:{secrets.token_hex(6)}",
        )
        for c in claimed:
            task = asyncio.create_task(self._attempt(session, c), name=f"webhook-{c.delivery_id}-{c.attempt}")
            self._attempts.add(task)
            task.add_done_callback(self._reap)
        return num_new >= INGEST_BATCH or len(claimed) >= free

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._attempts.discard(task)
        error = None if task.cancelled() else task.exception()
        # Either way the claim's lease runs out and another poll retries the attempt.
        if error is not None and is_redis_unavailable(error):
            log.warning("webhook attempt %s: its outcome could not be recorded, Redis unavailable (%s); "
                        "it is sent again when its claim runs out", task.get_name(), _unavailable_reason(error))
        elif error is not None:
            log.error("webhook attempt %s failed", task.get_name(), exc_info=error)
        self._wake.set()

    async def _drain(self) -> None:
        if not self._attempts:
            return
        _, pending = await asyncio.wait(set(self._attempts), timeout=self._config.webhook_drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _attempt(self, session: aiohttp.ClientSession, c: Claimed) -> None:
        span_cm: AbstractContextManager[Span | None] = (
            nullcontext(None) if self._observer is None else self._observer.webhook_span(c.traceparent, c.event, c.url)
        )
        with span_cm as span:
            started = time.monotonic()
            try:
                sent = await self._send(session, c)
            except asyncio.CancelledError:
                # Shutting down mid-attempt: hand it back so whoever polls next retries it without waiting for the lease.
                await self._store.release(c, now=time.time())
                raise
            now = time.time()
            decision = decide(self._policy, c.attempt, sent.status_code, sent.error, sent.retry_after_s,
                              self._rand.random(), is_refused=sent.is_refused)
            if span is not None:
                _describe_attempt(span, c, sent.status_code, sent.error, decision.outcome)
        record = AttemptRecord(
            delivery_id=c.delivery_id, event=c.event, attempt=c.attempt, at=now, status_code=sent.status_code,
            error=sent.error, next_at=None if decision.delay_s is None else now + decision.delay_s,
            outcome=decision.outcome.value,
        )
        if self._observer is not None:
            self._observer.webhook_attempt(c.event, decision.outcome.value, time.monotonic() - started)
        # The lines name the job and carry the attempt's trace, as every line about a job does.
        with job_context(c.job_id, span):
            if not await self._store.settle(c, decision, record, now=now):
                log.warning("webhook %s attempt %d: claim lapsed before it finished; left to its new holder",
                            c.delivery_id, c.attempt)
            elif decision.outcome is not AttemptOutcome.DELIVERED:
                # A retry is routine; giving a delivery up (dead-lettered) or a receiver's 410 is not.
                level = logging.INFO if decision.outcome is AttemptOutcome.RETRYING else logging.WARNING
                log.log(level, "webhook %s (%s of job %s) attempt %d: %s -> %s", c.delivery_id, c.event, c.job_id,
                        c.attempt, decision.reason, decision.outcome.value)

    async def _send(self, session: aiohttp.ClientSession, c: Claimed) -> Sent:
        """One POST and what it came to."""
        assert self._key is not None
        headers = signed_headers(self._key, c.delivery_id, int(time.time()), c.payload, USER_AGENT)
        try:
            check_webhook_url(c.url, self._allow)  # literal addresses never reach the resolver
            # The response body is never read: an endpoint cannot make us buffer an unbounded answer.
            async with session.post(c.url, data=c.payload, headers=headers, allow_redirects=False) as resp:
                return Sent(resp.status, None, parse_retry_after(resp.headers.get("Retry-After"), now=time.time()))
        except WebhookUrlError as e:
            # The scheme, the host's syntax, or an address the rules refuse (also one the host resolved to).
            return Sent(None, f"refused: {e}", is_refused=True)
        except (aiohttp.InvalidURL, UnicodeError) as e:
            # A URL the client cannot send to (a host it will not connect to, one IDNA cannot encode).
            return Sent(None, f"refused: webhook.url: cannot be sent to ({type(e).__name__}: {e})", is_refused=True)
        except asyncio.TimeoutError:
            return Sent(None, f"timed out after {self._config.webhook_timeout_s:g} s")
        except (aiohttp.ClientError, OSError) as e:
            return Sent(None, f"{type(e).__name__}: {e}")


def is_redis_unavailable(error: BaseException) -> bool:
    """Redis unreachable, silent past its timeout, loading, or at its maxmemory refusing writes: wait it out."""
    return isinstance(error, REDIS_UNAVAILABLE) or is_out_of_memory(error)


def _unavailable_reason(error: BaseException) -> str:
    return "at its maxmemory, refusing writes" if is_out_of_memory(error) else describe(error)


def _describe_attempt(span: Span, c: Claimed, status_code: int | None, error: str | None,
                      outcome: AttemptOutcome) -> None:
    span.set_attribute("carpool.job.id", c.job_id)
    span.set_attribute("carpool.webhook.attempt", c.attempt)
    span.set_attribute("carpool.webhook.outcome", outcome.value)
    if status_code is not None:
        span.set_attribute("http.response.status_code", status_code)
    if error is not None:
        span.set_attribute("carpool.webhook.error", error)
    if outcome is not AttemptOutcome.DELIVERED:
        span.set_status(Status(StatusCode.ERROR, error or f"receiver answered {status_code}"))
