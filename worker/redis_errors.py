"""Which Redis errors mean "not now" rather than "never": the worker waits those out and retries.

Redis is unavailable for a while when it cannot be reached (restarted, failed over, a network cut) and when it
is at its ``maxmemory`` under the ``noeviction`` policy, where it refuses every command that would add data
(an ``OOM`` reply, from inside a script too) until memory is freed. Neither is a fault of the job or of the
worker: nothing is given up on, failed or counted against a job for it.
"""

from __future__ import annotations

import logging

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler.protocol.redis_client import is_out_of_memory
from scheduler.runtime.outage_log import OutageLog

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
"""A dropped, unreachable or silent Redis (no reply within ``redis_client.REDIS_TIMEOUT_S``): whatever was being
written is retried later, never given up on."""

REDIS_ERRORS = (RedisError, OSError)
"""Every error a Redis call raises; ``is_redis_down`` tells the passing ones from the rest."""

REDIS_RETRY_S = 0.5
"""How long a loop that found Redis unavailable waits before it tries again."""


MAXMEMORY_RETRY_MAX_S = 4.0
"""The longest wait between tries of a write Redis keeps refusing at maxmemory (`RetryDelay`)."""


class RetryDelay:
    """How long a write Redis refused for now (`is_redis_down`) waits before its next try: `REDIS_RETRY_S` while
    Redis cannot be reached, and, for a write refused at maxmemory, twice as long with each refusal in a row up to
    `MAXMEMORY_RETRY_MAX_S`. Every try of a refused write holds its arguments in Redis's memory while Redis reads
    and refuses them: a 2 MB job start tried every half second keeps memory over the limit much of the time, and
    with it every smaller write out, the worker's own reads and heartbeats too."""

    def __init__(self) -> None:
        self._refusals = 0

    def after(self, error: BaseException) -> float:
        if not is_out_of_memory(error):
            self._refusals = 0
            return REDIS_RETRY_S
        self._refusals += 1
        return min(REDIS_RETRY_S * 2 ** min(self._refusals - 1, 16), MAXMEMORY_RETRY_MAX_S)


def is_redis_down(error: BaseException) -> bool:
    """Whether ``error`` says Redis is unavailable for now: unreachable, or at maxmemory refusing writes."""
    return isinstance(error, REDIS_DOWN) or is_out_of_memory(error)


def outage_log(logger: logging.Logger) -> OutageLog:
    """The worker's places that retry every `REDIS_RETRY_S` say an outage through one of these."""
    return OutageLog(logger, retry_s=REDIS_RETRY_S)
