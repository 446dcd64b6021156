"""What the gateway knows of the model's limits: its context length (`--max-model-len`, else learned from the
workers) and its vocabulary's size (learned from the workers).

Every worker's heartbeat (`carpool:workers`) carries its engine's `max_model_len` and `vocab_size`; the
smallest of each among recent heartbeats bounds what every worker can run. They are re-read at most every
`REFRESH_S`; with no heartbeat yet the gateway knows no limit and the worker judges.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis

from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash

REFRESH_S = 2.0
"""How long learned limits are trusted before the heartbeats are read again."""
STALE_HEARTBEAT_S = 60.0
"""Heartbeats older than this are of workers that are gone (a killed worker leaves its entry)."""


@dataclass(frozen=True)
class Limits:
    max_model_len: int | None
    """The longest prompt + output, or None when no worker said."""
    vocab_size: int | None
    """Token ids must be below this, or None when no worker said."""


class ModelLimits:
    def __init__(self, redis: aioredis.Redis, keys: Keys, configured_max_model_len: int | None) -> None:
        self._redis = redis
        self._keys = keys
        self._configured = configured_max_model_len
        self._learned = Limits(None, None)
        self._read_at = -REFRESH_S

    async def get(self) -> Limits:
        """The limits to admit jobs against (`--max-model-len` over the learned context length)."""
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            self._learned = await self._from_heartbeats()
            self._read_at = now
        if self._configured is not None:
            return Limits(self._configured, self._learned.vocab_size)
        return self._learned

    async def _from_heartbeats(self) -> Limits:
        lengths: list[int] = []
        vocab_sizes: list[int] = []
        for raw in (await read_hash(self._redis, self._keys.workers)).values():
            try:
                beat = msgpack.unpackb(raw, raw=False)
            except Exception:
                continue  # a heartbeat in another format says nothing about the model
            if not isinstance(beat, dict) or time.time() - float(beat.get("time", 0)) > STALE_HEARTBEAT_S:
                continue
            for name, found in (("max_model_len", lengths), ("vocab_size", vocab_sizes)):
                value = beat.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.append(value)
        return Limits(min(lengths) if lengths else None, min(vocab_sizes) if vocab_sizes else None)
