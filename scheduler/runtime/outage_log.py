"""Warnings of Redis being unavailable, said once in a while instead of at every retry.

Every carpool process retries what met an unavailable Redis every second or so, in several places at once (a
worker's loops, its commits and admissions; a gateway's event hub and batch driver; a webhook dispatcher). Logged
at every retry, an outage would fill the log with a line or more per second per place for as long as it lasts.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

OUTAGE_LOG_EVERY_S = 30.0
"""While an outage lasts, each place that meets it says so at most once in this many seconds."""


def describe(error: BaseException) -> str:
    """An error's message for a log line; its type where it has none (a bare timeout says nothing itself)."""
    return str(error) or type(error).__name__


class OutageLog:
    """Warnings of Redis being unavailable, at most one every `every_s` seconds for each place that meets it (a
    loop, commits, admissions), with how many were left out; `retry_s`: how often those places retry."""

    def __init__(self, logger: logging.Logger, *, retry_s: float, every_s: float = OUTAGE_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._retry_s = retry_s
        self._every_s = every_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._left_out: Counter[str] = Counter()
        self._since: float | None = None
        """When the outage now going on was first met; None while none is."""
        self._is_said = False
        """Whether a warning of the outage now going on was logged (its end is said only then)."""

    def warn(self, where: str, error: BaseException, detail: str = "") -> None:
        """`where` met Redis unavailable (`error`); `detail` names what waits (a job, an entry). A place that
        warned less than `every_s` ago is not heard again, whether this is the same outage or a new one: a Redis
        that refuses some writes and takes others (at maxmemory, say) ends and starts an outage many times a
        second."""
        now = self._clock()
        if self._since is None:
            self._since = now
        last = self._last.get(where)
        if last is not None and now - last < self._every_s:
            self._left_out[where] += 1
            return
        self._last[where] = now
        self._is_said = True
        left_out = self._left_out.pop(where, 0)
        said = f"; {left_out} more such since the last of these" if left_out else ""
        self._logger.warning("%s%s: Redis unavailable (%s); retrying every %.1fs, said again at most every %.0fs%s",
                             where, f" ({detail})" if detail else "", describe(error), self._retry_s, self._every_s,
                             said)

    def recovered(self) -> None:
        """Redis answered again: say so once if a warning of this outage was logged. The warnings left out stay
        counted, for the next one said."""
        if self._since is None:
            return
        if self._is_said:
            left_out = sum(self._left_out.values())
            # Counted from the first warning, which a silent Redis delays by the timeout of the call that met it.
            self._logger.info("Redis available again, %.0fs after the first warning%s", self._clock() - self._since,
                              f" ({left_out} warning{'s' if left_out > 1 else ''} left out)" if left_out else "")
            self._left_out.clear()
        self._since = None
        self._is_said = False
