"""Which Redis errors mean "not now" rather than "never": the worker waits those out and retries.

Redis is unavailable for a while when it cannot be reached (restarted, failed over, a network cut) and when it
is at its ``maxmemory`` under the ``noeviction`` policy, where it refuses every command that would add data
(an ``OOM`` reply, from inside a script too) until memory is freed. Neither is a fault of the job or of the
worker: nothing is given up on, failed or counted against a job for it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler.protocol.redis_client import is_out_of_memory

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
"""A dropped, unreachable or silent Redis (no reply within ``redis_client.REDIS_TIMEOUT_S``): whatever was being
written is retried later, never given up on."""

REDIS_ERRORS = (RedisError, OSError)
"""Every error a Redis call raises; ``is_redis_down`` tells the passing ones from the rest."""

REDIS_RETRY_S = 0.5
"""How long a loop that found Redis unavailable waits before it tries again."""


def describe(error: BaseException) -> str:
    """An error's message for a log line; its type where it has none (a bare timeout says nothing itself)."""
    return str(error) or type(error).__name__


def is_redis_down(error: BaseException) -> bool:
    """Whether ``error`` says Redis is unavailable for now: unreachable, or at maxmemory refusing writes."""
    return isinstance(error, REDIS_DOWN) or is_out_of_memory(error)


OUTAGE_LOG_EVERY_S = 30.0
"""While an outage lasts, each place that meets it says so at most once in this many seconds."""


class OutageLog:
    """Warnings of Redis being unavailable, at most one every `every_s` seconds for each place that meets it (a
    loop, commits, admissions), with how many were left out: retrying every `REDIS_RETRY_S`, each would otherwise
    log twice a second, and every job's commit too, for as long as the outage lasts."""

    def __init__(self, logger: logging.Logger, every_s: float = OUTAGE_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._left_out: Counter[str] = Counter()
        self._since: float | None = None
        """When the outage now logged was first warned of; None while none is."""

    def warn(self, where: str, error: BaseException, detail: str = "") -> None:
        """`where` met Redis unavailable (`error`); `detail` names what waits (a job, an entry)."""
        now = self._clock()
        if self._since is None:
            self._since = now
        last = self._last.get(where)
        if last is not None and now - last < self._every_s:
            self._left_out[where] += 1
            return
        self._last[where] = now
        left_out = self._left_out.pop(where, 0)
        said = f"; {left_out} more such since the last of these" if left_out else ""
        self._logger.warning("%s%s: Redis unavailable (%s); retrying every %.1fs, said again at most every %.0fs%s",
                             where, f" ({detail})" if detail else "", describe(error), REDIS_RETRY_S, self._every_s,
                             said)

    def recovered(self) -> None:
        """Redis answered again: say so once if an outage was logged, and log the next one from its start."""
        if self._since is None:
            return
        left_out = sum(self._left_out.values())
        # Counted from the first warning, which a silent Redis delays by the timeout of the call that met it.
        self._logger.info("Redis available again, %.0fs after the first warning%s", self._clock() - self._since,
                          f" ({left_out} warnings left out)" if left_out else "")
        self._since = None
        self._last.clear()
        self._left_out.clear()
