"""What the gateway knows of the model's limits: its context length (learned from the workers, and capped by
`--max-model-len`) and its vocabulary's size (learned from the workers).

Every worker's heartbeat (`carpool:workers`) carries its engine's `max_model_len` and `vocab_size`; the
smallest of each among live workers' heartbeats (`--model-heartbeat-max-age-s`) bounds what every worker can
run. They are re-read at most every `REFRESH_S`; with no live worker the gateway knows no limit but its own
`--max-model-len`, and the worker judges. A `--max-model-len` above what the workers hold changes nothing: a job
the workers' context cannot hold is refused here rather than failed by a worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from scheduler.protocol.keys import Keys
from scheduler.protocol.worker_heartbeats import recent_heartbeats

REFRESH_S = 2.0
"""How long learned limits are trusted before the heartbeats are read again."""


@dataclass(frozen=True)
class Limits:
    max_model_len: int | None
    """The longest prompt + output, or None when no worker said."""
    vocab_size: int | None
    """Token ids must be below this, or None when no worker said."""


class ModelLimits:
    def __init__(self, redis: aioredis.Redis, keys: Keys, configured_max_model_len: int | None,
                 heartbeat_max_age_s: float) -> None:
        self._redis = redis
        self._keys = keys
        self._max_age_s = heartbeat_max_age_s
        self._configured = configured_max_model_len
        self._learned = Limits(None, None)
        self._read_at = -REFRESH_S

    async def get(self) -> Limits:
        """The limits to admit jobs against (the smaller of `--max-model-len` and the learned context length)."""
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            self._learned = await self._from_heartbeats()
            self._read_at = now
        learned = self._learned.max_model_len
        if self._configured is not None and (learned is None or self._configured < learned):
            return Limits(self._configured, self._learned.vocab_size)
        return self._learned

    async def _from_heartbeats(self) -> Limits:
        lengths: list[int] = []
        vocab_sizes: list[int] = []
        for beat in await recent_heartbeats(self._redis, self._keys.workers, max_age_s=self._max_age_s,
                                            now=time.time()):
            for name, found in (("max_model_len", lengths), ("vocab_size", vocab_sizes)):
                value = beat.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.append(value)
        return Limits(min(lengths) if lengths else None, min(vocab_sizes) if vocab_sizes else None)
