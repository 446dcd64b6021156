"""The jobs behind one OpenAI request: enqueue them together, watch their events, cancel what is left."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from gateway import appkeys
from gateway.admission import IdempotencyInFlight, InvalidJob, JobIdTaken, LaneFull, QuotaExceeded
from gateway.api_keys import OPEN_CALLER, Caller
from gateway.cancel import AlreadyFinished, JobNotFound
from gateway.errors import OpenAIError
from gateway.event_hub import EventHub, Subscription, is_terminal
from gateway.openai.responses import CONTEXT_LENGTH_EXCEEDED, openai_param, renamed_in
from gateway.openai.schema import OpenAIRequest
from gateway.rate_limits import RateLimited, TooManyTokens, job_tokens
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash
from scheduler.protocol.worker_heartbeats import recent_heartbeats
from scheduler.runtime.tasks import cancel_and_reap



async def served_models(app: web.Application) -> dict[str, float]:
    """Model name -> when the earliest of the workers serving it started (its `created`: the same at every
    call while they live), over workers heard from within the configured age; a heartbeat without its worker's
    start gives its own time."""
    models: dict[str, float] = {}
    for beat in await recent_heartbeats(app[appkeys.REDIS], app[appkeys.KEYS].workers,
                                        max_age_s=app[appkeys.CONFIG].model_heartbeat_max_age_s, now=time.time()):
        if isinstance(beat.get("model"), str):
            started = beat.get("started")
            since = float(started if isinstance(started, (int, float)) else beat["time"])
            models[beat["model"]] = min(models.get(beat["model"], since), since)
    return models


@dataclass(frozen=True)
class ModelChoice:
    """The model names a request may ask for now (any, when `names` is empty: a deployment whose workers have
    never been heard from), and the words that say where they come from."""

    names: frozenset[str]
    source: str

    def refusal(self, model: str) -> str | None:
        """Why `model` is refused, or None when its jobs may be enqueued."""
        if not self.names or model in self.names:
            return None
        return f"The model '{model}' does not exist; {self.source} {sorted(self.names)}"


async def model_choice(app: web.Application) -> ModelChoice:
    """The models live workers serve; with none live, those the deployment's workers served within the queued
    TTL (a request for one of them waits in its lane for a worker, as any job does; one for another name is
    refused, rather than run by whichever model comes)."""
    live = await served_models(app)
    if live:
        return ModelChoice(frozenset(live), "this server serves")
    redis, key = app[appkeys.REDIS], app[appkeys.KEYS].models
    since = time.time() - app[appkeys.CONFIG].queued_ttl_s
    recent: set[str] = set()
    stale: list[bytes] = []
    for name, seen in (await read_hash(redis, key)).items():
        try:
            is_recent = float(seen) >= since
        except ValueError:
            is_recent = False
        if is_recent:
            recent.add(name.decode(errors="replace"))
        else:
            stale.append(name)
    if stale:
        await redis.hdel(key, *stale)
    return ModelChoice(frozenset(recent), "no worker is running now; this server's workers serve")


async def check_model(app: web.Application, model: str) -> None:
    """Refuse a model that no live worker serves, or with none live, that none of the deployment's served lately."""
    reason = (await model_choice(app)).refusal(model)
    if reason is not None:
        raise OpenAIError(404, reason, param="model", code="model_not_found")


async def submit_choices(app: web.Application, request: OpenAIRequest, job_ids: Sequence[str],
                         caller: Caller = OPEN_CALLER) -> dict[str, str]:
    """Enqueue one job per choice, as `caller`'s; all or none (a refusal cancels the ones already enqueued, and
    the first job is admitted only with room in the tenant's quota for every choice). Returns the
    x-ratelimit-* headers the request earned (none for a caller without rate limits)."""
    admission, metrics, limiter = app[appkeys.ADMISSION], app[appkeys.METRICS], app[appkeys.LIMITER]
    num_choices, max_queued = len(request.jobs), caller.limits.max_queued
    lane = str(request.jobs[0]["lane"])  # every choice's: the request's
    if max_queued is not None and num_choices > max_queued:
        metrics.job_rejected("quota", lane)
        raise OpenAIError(400, f"n={num_choices} needs {num_choices} jobs queued at once, more than this key's "
                               f"max_queued of {max_queued}; ask for at most n={max_queued}",
                          param="n", code="queued_jobs_limit")
    max_depth = app[appkeys.CONFIG].max_lane_depth[lane]
    if num_choices > max_depth:
        metrics.job_rejected("invalid", lane)  # a request no wait can admit, not a full lane
        raise OpenAIError(400, f"n={num_choices} needs {num_choices} jobs queued at once, more than the {lane} "
                               f"lane holds ({max_depth}); ask for at most n={max_depth}",
                          param="n", code="lane_depth_limit")
    max_model_len = await admission.context_length()
    try:
        reserved, headers = await limiter.reserve(caller, [job_tokens(body, max_model_len) for body in request.jobs])
    except TooManyTokens as e:
        metrics.job_rejected("rate_limited", lane)
        raise OpenAIError(400, str(e), param="max_tokens", code="rate_limit_exceeded") from e
    except RateLimited as e:
        metrics.job_rejected("rate_limited", lane)
        raise OpenAIError(429, e.message, code="rate_limit_exceeded", headers=e.headers) from e
    done: list[str] = []
    try:
        for job_id, body, reservation in zip(job_ids, request.jobs, reserved.jobs):
            admitted = await admission.submit({**body, "id": job_id}, None, caller=caller, reservation=reservation,
                                              num_following=num_choices - 1 - len(done))
            metrics.job_submitted(admitted.lane)
            done.append(job_id)
    except (InvalidJob, QuotaExceeded, LaneFull, IdempotencyInFlight) as e:
        await cancel_jobs(app, done)
        after = await limiter.release(caller, reserved, reserved.jobs[len(done):])
        refusal = _refusal(app, e, lane, request.renames)
        if refusal.status == 429:  # the window as it stands after the refusal, as on POST /v1/jobs
            refusal.headers.update(after)
        raise refusal from e
    except BaseException:  # the client went away mid-admission, say: what was enqueued goes, what was not is
        # given back, as for a refusal
        await asyncio.shield(cancel_jobs(app, done))
        await asyncio.shield(limiter.release(caller, reserved, reserved.jobs[len(done):]))
        raise
    return headers


def _refusal(app: web.Application, e: Exception, lane: str, renames: dict[str, str]) -> OpenAIError:
    """A refused choice (of `lane`) as the request's error, counted in the metrics."""
    metrics, retry_after_s = app[appkeys.METRICS], app[appkeys.CONFIG].retry_after_s
    if isinstance(e, JobIdTaken):  # ids are fresh: only a collision
        metrics.job_rejected("conflict", lane)
        return OpenAIError(409, "request id collision; retry", code="conflict")
    if isinstance(e, InvalidJob):
        metrics.job_rejected("invalid", lane)
        param = openai_param(e.field, renames)
        code = CONTEXT_LENGTH_EXCEEDED if e.is_context_exceeded else "invalid_value"
        return OpenAIError(400, f"{param}: {renamed_in(e.message, renames)}", param=param, code=code)
    if isinstance(e, QuotaExceeded):
        metrics.job_rejected("quota", lane)
        return OpenAIError(429, f"{e}; retry later", code="queued_jobs_limit", retry_after_s=retry_after_s)
    if isinstance(e, LaneFull):
        metrics.job_rejected("lane_full", e.lane.value)
        return OpenAIError(429, f"{e}; retry later", code="lane_full", retry_after_s=retry_after_s)
    metrics.job_rejected("conflict", lane)
    return OpenAIError(409, "request id collision; retry", code="conflict")  # ids are fresh: only a collision


async def cancel_jobs(app: web.Application, job_ids: Sequence[str]) -> None:
    """Cancel every job not finished yet (a client that went away must leave no compute behind)."""
    canceller = app[appkeys.CANCELLER]
    for job_id in job_ids:
        try:
            await canceller.cancel(job_id)
        except (JobNotFound, AlreadyFinished):
            pass


class ChoiceWatch:
    """Every choice's job events merged into one queue; enter it before the jobs are enqueued."""

    def __init__(self, redis: aioredis.Redis, hub: EventHub, keys: Keys, job_ids: Sequence[str]) -> None:
        self._redis, self._hub, self._keys = redis, hub, keys
        self.job_ids = list(job_ids)
        self._merged: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        self._stack = AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> ChoiceWatch:
        try:
            for index, job_id in enumerate(self.job_ids):
                sub = await self._stack.enter_async_context(self._hub.subscribe(self._keys.events(job_id)))
                self._tasks.append(asyncio.create_task(self._forward(index, sub), name=f"choice-{job_id}"))
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for task in self._tasks:
            await cancel_and_reap(task)
        await self._stack.aclose()

    async def _forward(self, index: int, sub: Subscription) -> None:
        while True:
            self._merged.put_nowait((index, await sub.queue.get()))

    async def next(self, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
        try:
            return await asyncio.wait_for(self._merged.get(), timeout_s)
        except TimeoutError:
            return None

    async def terminal_views(self, indices: Sequence[int]) -> dict[int, dict[str, Any]]:
        """The views of those jobs whose record is terminal now (a final event lost in transit still shows)."""
        out = {}
        for index in indices:
            record = await read_hash(self._redis, self._keys.job(self.job_ids[index]))
            if record and is_terminal(record):
                out[index] = job_view(record)
        return out
