"""Per-tenant rate limits: requests and tokens per minute, counted in Redis so every gateway agrees.

A job-creating request reserves one request and its tokens (prompt + ``max_tokens`` of every job it
makes) in the tenant's current window, atomically; over a limit it is refused with 429, ``Retry-After``
and the ``x-ratelimit-*`` headers OpenAI sends. Each job's share of the reservation is written on its
record; the worker that decides the job replaces it by the tokens really used (``scheduler.tenant_lua``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.api_keys import Caller
from scheduler import tenant_lua
from scheduler.keys import RATE_WINDOW_MS, Keys
from scheduler.params import SamplingParams
from scheduler.tenants import estimate_tokens

_DEFAULT_MAX_TOKENS = SamplingParams().max_tokens


@dataclass(frozen=True)
class Reservation:
    """Tokens one job holds in its tenant's window `window_id` (the window's start, unix ms)."""

    window_id: str
    tokens: int

    @property
    def field_value(self) -> str:
        """As the job record's ``reservation`` field."""
        return f"{self.window_id} {self.tokens}"


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s), **headers}


def job_tokens(body: Mapping[str, Any]) -> int:
    """Tokens a job's wire map reserves: its prompt (exact for token ids, estimated for text) + max_tokens."""
    token_ids, text, messages = body.get("prompt_token_ids"), body.get("prompt"), body.get("messages")
    if isinstance(token_ids, list):
        prompt = len(token_ids)
    elif isinstance(text, str):
        prompt = estimate_tokens(text)
    else:
        prompt = sum(estimate_tokens(str(m.get("content", ""))) + 4
                     for m in (messages if isinstance(messages, list) else []) if isinstance(m, dict))
    params = body.get("params")
    max_tokens = params.get("max_tokens", _DEFAULT_MAX_TOKENS) if isinstance(params, dict) else _DEFAULT_MAX_TOKENS
    return max(1, prompt) + (max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0)


def reset_text(ms: int) -> str:
    """A window's time left as OpenAI writes it: ``250ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


class RateLimiter:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._reserve = redis.register_script(tenant_lua.RESERVE)
        self._release = redis.register_script(tenant_lua.RELEASE)

    async def reserve(self, caller: Caller, job_costs: Iterable[int]) -> tuple[list[Reservation | None], dict[str, str]]:
        """Reserve one request and the jobs' tokens: (each job's reservation, the x-ratelimit headers).

        Raises RateLimited. A caller without limits reserves nothing and gets no headers."""
        costs = list(job_costs)
        limits = caller.limits
        if not limits.is_rate_limited:
            return [None] * len(costs), {}
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        total = sum(costs)
        verdict, requests, tokens, left_ms, window = await self._reserve(
            keys=[self._keys.tenant_window(caller.tenant)],
            args=[int(time.time() * 1000), RATE_WINDOW_MS, "" if rpm is None else rpm, "" if tpm is None else tpm,
                  total])
        verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
        window_id = window.decode() if isinstance(window, bytes) else str(window)
        left_ms = max(int(left_ms), 0)
        headers: dict[str, str] = {}
        if rpm is not None:
            headers |= {"x-ratelimit-limit-requests": str(rpm),
                        "x-ratelimit-remaining-requests": str(max(rpm - int(requests), 0)),
                        "x-ratelimit-reset-requests": reset_text(left_ms)}
        if tpm is not None:
            headers |= {"x-ratelimit-limit-tokens": str(tpm),
                        "x-ratelimit-remaining-tokens": str(max(tpm - int(tokens), 0)),
                        "x-ratelimit-reset-tokens": reset_text(left_ms)}
        if verdict == "requests":
            raise RateLimited(f"Rate limit reached for tenant {caller.tenant!r} on requests per minute: "
                              f"limit {rpm}, used {requests}", math.ceil(left_ms / 1000) or 1, headers)
        if verdict == "tokens":
            raise RateLimited(f"Rate limit reached for tenant {caller.tenant!r} on tokens per minute: limit {tpm}, "
                              f"used {tokens}, requested {total}", math.ceil(left_ms / 1000) or 1, headers)
        tpm_on = tpm is not None
        return [Reservation(window_id, cost) if tpm_on else None for cost in costs], headers

    async def release(self, caller: Caller, reservations: Iterable[Reservation | None]) -> None:
        """Give back reservations whose jobs were never enqueued."""
        for r in reservations:
            if r is not None:
                await self._release(keys=[self._keys.tenant_window(caller.tenant)], args=[r.window_id, r.tokens])
