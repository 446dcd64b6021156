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
LASTING_RETRIES = 4
"""A new outage is said within that interval once it has lasted this many retries: one that ends at once, as
when a Redis at maxmemory refuses some writes and takes other calls, waits for the interval."""


def describe(error: BaseException) -> str:
    """An error's message for a log line; its type where it has none (a bare timeout says nothing itself)."""
    return str(error) or type(error).__name__


class OutageLog:
    """Warnings of Redis being unavailable, at most one every `every_s` seconds for each place that meets it (a
    loop, commits, admissions), with how many were left out; `retry_s`: how often those places retry.
    `meanwhile`: what each warning says is done while it lasts (default: retrying every `retry_s`)."""

    def __init__(self, logger: logging.Logger, *, retry_s: float, every_s: float = OUTAGE_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, meanwhile: str | None = None) -> None:
        self._logger = logger
        self._retry_s = retry_s
        self._meanwhile = meanwhile or f"retrying every {retry_s:.1f}s"
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
        warned less than `every_s` ago is heard again only for a new outage that has lasted `LASTING_RETRIES`
        retries: a Redis that refuses some writes and takes others (at maxmemory, say) ends and starts an
        outage many times a second, and is said once an interval."""
        now = self._clock()
        if self._since is None:
            self._since = now
        last = self._last.get(where)
        is_lasting_news = not self._is_said and now - self._since >= LASTING_RETRIES * self._retry_s
        if last is not None and now - last < self._every_s and not is_lasting_news:
            self._left_out[where] += 1
            return
        self._last[where] = now
        self._is_said = True
        left_out = self._left_out.pop(where, 0)
        said = f"; {left_out} more such since the last of these" if left_out else ""
        self._logger.warning("%s%s: Redis unavailable (%s); %s, said again at most every %.0fs%s",
                             where, f" ({detail})" if detail else "", describe(error), self._meanwhile, self._every_s,
                             said)

    def recovered(self) -> None:
        """Redis answered again: say so once if a warning of this outage was logged. The warnings left out stay
        counted, for the next one said."""
        if self._since is None:
            return
        if self._is_said:
            left_out = sum(self._left_out.values())
            # Counted from the first call that met it, which a silent Redis delays by that call's timeout.
            self._logger.info("Redis available again, %.0fs after it was first found unavailable%s",
                              self._clock() - self._since,
                              f" ({left_out} warning{'s' if left_out > 1 else ''} left out)" if left_out else "")
            self._left_out.clear()
        self._since = None
        self._is_said = False
