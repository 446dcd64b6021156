"""The model's context length as the gateway knows it: `--max-model-len`, else learned from the workers.

Every worker's heartbeat (`carpool:workers`) carries its engine's `max_model_len`; the smallest
among recent heartbeats is the longest prompt + output that any worker can run. It is re-read
at most every `REFRESH_S`; with no heartbeat yet the gateway knows no limit and the worker judges.
"""

from __future__ import annotations

import time

import msgpack
import redis.asyncio as aioredis

from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash

REFRESH_S = 2.0
"""How long a learned context length is trusted before the heartbeats are read again."""
STALE_HEARTBEAT_S = 60.0
"""Heartbeats older than this are of workers that are gone (a killed worker leaves its entry)."""


class ContextLength:
    def __init__(self, redis: aioredis.Redis, keys: Keys, configured: int | None) -> None:
        self._redis = redis
        self._keys = keys
        self._configured = configured
        self._learned: int | None = None
        self._read_at = -REFRESH_S

    async def get(self) -> int | None:
        """The context length to admit jobs against, or None when no worker has said yet."""
        if self._configured is not None:
            return self._configured
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            self._learned = await self._from_heartbeats()
            self._read_at = now
        return self._learned

    async def _from_heartbeats(self) -> int | None:
        lengths: list[int] = []
        for raw in (await read_hash(self._redis, self._keys.workers)).values():
            try:
                beat = msgpack.unpackb(raw, raw=False)
            except Exception:
                continue  # a heartbeat in another format says nothing about the context
            if not isinstance(beat, dict) or time.time() - float(beat.get("time", 0)) > STALE_HEARTBEAT_S:
                continue
            length = beat.get("max_model_len")
            if isinstance(length, int) and length > 0:
                lengths.append(length)
        return min(lengths) if lengths else None
