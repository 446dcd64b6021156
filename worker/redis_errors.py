"""Which Redis errors mean "not now" rather than "never": the worker waits those out and retries.

Redis is unavailable for a while when it cannot be reached (restarted, failed over, a network cut) and when it
is at its ``maxmemory`` under the ``noeviction`` policy, where it refuses every command that would add data
(an ``OOM`` reply, from inside a script too) until memory is freed. Neither is a fault of the job or of the
worker: nothing is given up on, failed or counted against a job for it.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
"""A dropped or unreachable Redis: whatever was being written is retried later, never given up on."""

REDIS_ERRORS = (RedisError, OSError)
"""Every error a Redis call raises; ``is_redis_down`` tells the passing ones from the rest."""

REDIS_RETRY_S = 0.5
"""How long a loop that found Redis unavailable waits before it tries again."""

_OOM_REPLY = "OOM command not allowed"
"""How Redis at maxmemory refuses a write; a script's error carries it inside its own text."""


def is_redis_down(error: BaseException) -> bool:
    """Whether ``error`` says Redis is unavailable for now: unreachable, or at maxmemory refusing writes."""
    if isinstance(error, (*REDIS_DOWN, OutOfMemoryError)):
        return True
    return isinstance(error, ResponseError) and _OOM_REPLY in str(error)
