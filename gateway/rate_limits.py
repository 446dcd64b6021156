"""Per-tenant rate limits: requests and tokens per minute, counted in Redis so every gateway agrees.

A job-creating request reserves one request and its tokens (prompt + ``max_tokens`` of every job it
makes) in the tenant's current window, atomically; over a limit it is refused with 429, ``Retry-After``
and the ``x-ratelimit-*`` headers OpenAI sends. A request that ends up enqueuing nothing (refused after
reserving, or answered with a job that already existed) gives its request and tokens back. Each job's share
of the reservation is written on its record; the worker that decides the job replaces it by the tokens
really used (``scheduler.protocol.state_machine``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.api_keys import Caller
from scheduler.params import SamplingParams
from scheduler.protocol import state_machine
from scheduler.protocol.keys import RATE_WINDOW_MS, Keys
from scheduler.protocol.tenants import TenantLimits, estimate_tokens

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


@dataclass(frozen=True)
class Reserved:
    """What one request holds in its tenant's window: the request itself, and each of its jobs' tokens."""

    window_id: str | None
    """None when the caller has no rate limits: nothing was counted."""
    jobs: list[Reservation | None]
    """Per job, in order; None where the caller has no rate limits."""


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: int, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s), **headers}


class TooManyTokens(Exception):
    """The request alone reserves more tokens than its key allows per minute: no retry can admit it."""

    def __init__(self, tokens: int, tokens_per_minute: int) -> None:
        super().__init__(f"this request reserves {tokens} tokens (its prompt plus max_tokens, for every choice; "
                         f"without max_tokens the rest of the model's context), more than the key's "
                         f"{tokens_per_minute} tokens per minute: set a smaller max_tokens")
        self.tokens = tokens
        self.tokens_per_minute = tokens_per_minute


def job_tokens(body: Mapping[str, Any], max_model_len: int | None) -> int | None:
    """Tokens a job's wire map may use: its prompt (exact for token ids, estimated for text) + max_tokens.

    A job whose ``max_tokens`` is null may generate to the end of the model's context, so it counts the whole
    context (`max_model_len`), or its prompt if that is longer (the worker then fails it); None when the
    context length is not known yet.
    """
    token_ids, text, messages = body.get("prompt_token_ids"), body.get("prompt"), body.get("messages")
    if isinstance(token_ids, list):
        prompt = len(token_ids)
    elif isinstance(text, str):
        prompt = estimate_tokens(text)
    else:
        prompt = sum(estimate_tokens(str(m.get("content", ""))) + 4
                     for m in (messages if isinstance(messages, list) else []) if isinstance(m, dict))
    prompt = max(1, prompt)
    params = body.get("params")
    max_tokens = params.get("max_tokens", _DEFAULT_MAX_TOKENS) if isinstance(params, dict) else _DEFAULT_MAX_TOKENS
    if max_tokens is None:
        return None if max_model_len is None else max(prompt, max_model_len)
    return prompt + (max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0)


def reset_text(ms: int) -> str:
    """A window's time left as OpenAI writes it (Go's duration format): ``6ms``, ``1.5s``, ``59.96s``, ``1m0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    seconds = f"{ms // 1000}.{ms % 1000:03d}".rstrip("0").rstrip(".") + "s"
    return f"{minutes}m{seconds}" if minutes else seconds


class RateLimiter:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._reserve = redis.register_script(state_machine.RESERVE)
        self._release = redis.register_script(state_machine.RELEASE_RESERVATION)

    async def reserve(self, caller: Caller, job_costs: Sequence[int | None]) -> tuple[Reserved, dict[str, str]]:
        """Reserve one request and the jobs' tokens (`job_tokens`; jobs that count None share the key's whole
        tokens per minute, as nothing smaller bounds them): (the reservation, the x-ratelimit headers).

        Raises RateLimited, or TooManyTokens when the jobs alone exceed the tokens limit. A caller without
        limits reserves nothing and gets no headers."""
        limits = caller.limits
        if not limits.is_rate_limited:
            return Reserved(None, [None] * len(job_costs)), {}
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        costs = [(tpm or 0) // len(job_costs) if cost is None else cost for cost in job_costs]
        total = sum(costs)
        if tpm is not None and total > tpm:
            raise TooManyTokens(total, tpm)
        verdict, requests, tokens, left_ms, window = await self._reserve(
            keys=[self._keys.tenant_window(caller.tenant)],
            args=[int(time.time() * 1000), RATE_WINDOW_MS, "" if rpm is None else rpm, "" if tpm is None else tpm,
                  total])
        verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
        window_id = window.decode() if isinstance(window, bytes) else str(window)
        left_ms = max(int(left_ms), 0)
        headers = _headers(limits, int(requests), int(tokens), left_ms)
        if verdict == "requests":
            raise RateLimited(f"Rate limit reached for tenant {caller.tenant!r} on requests per minute: "
                              f"limit {rpm}, used {requests}", math.ceil(left_ms / 1000) or 1, headers)
        if verdict == "tokens":
            raise RateLimited(f"Rate limit reached for tenant {caller.tenant!r} on tokens per minute: limit {tpm}, "
                              f"used {tokens}, requested {total}", math.ceil(left_ms / 1000) or 1, headers)
        # Counted and settled whether or not this key limits tokens: the window is the tenant's, and another of
        # its keys may.
        return Reserved(window_id, [Reservation(window_id, cost) for cost in costs]), headers

    async def release(self, caller: Caller, reserved: Reserved,
                      jobs: Sequence[Reservation | None] | None = None) -> dict[str, str]:
        """Give back a request that enqueued nothing new, with the tokens of `jobs` (default: all of its jobs),
        those it did not enqueue; the tokens of jobs it did enqueue are settled when they end. Returns the
        x-ratelimit headers as the window stands after."""
        if reserved.window_id is None:
            return {}
        tokens = sum(r.tokens for r in (reserved.jobs if jobs is None else jobs) if r is not None)
        requests, tokens_now, left_ms = await self._release(
            keys=[self._keys.tenant_window(caller.tenant)], args=[reserved.window_id, 1, tokens])
        return _headers(caller.limits, int(requests), int(tokens_now), max(int(left_ms), 0))


def _headers(limits: TenantLimits, requests: int, tokens: int, left_ms: int) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for a window holding `requests` and `tokens` with `left_ms` to go."""
    headers: dict[str, str] = {}
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    if rpm is not None:
        headers |= {"x-ratelimit-limit-requests": str(rpm),
                    "x-ratelimit-remaining-requests": str(max(rpm - requests, 0)),
                    "x-ratelimit-reset-requests": reset_text(left_ms)}
    if tpm is not None:
        headers |= {"x-ratelimit-limit-tokens": str(tpm),
                    "x-ratelimit-remaining-tokens": str(max(tpm - tokens, 0)),
                    "x-ratelimit-reset-tokens": reset_text(left_ms)}
    return headers
