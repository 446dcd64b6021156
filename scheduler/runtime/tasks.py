"""Cancellation that long-lived loops can rely on, on every supported Python.

On Python 3.11, ``asyncio.wait_for`` returns the inner result instead of
raising when a cancel reaches it in the same loop turn as that result (3.12
rewrote it on ``asyncio.timeout`` and no longer does). redis-py calls
``wait_for`` on connects and reads, so a ``task.cancel()`` aimed at a polling
loop is now and then dropped: the task runs on with ``cancelling()`` still
counting the request, sleeps, polls again, and its owner's ``await task``
never returns. Every owned loop calls `raise_if_cancelled` once a turn, after
its Redis call and before it sleeps, so a dropped request still stops it.
"""

from __future__ import annotations

import asyncio
from typing import Any


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the running task was asked to stop and the request got lost on the way."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError


async def cancel_and_reap(task: asyncio.Task[Any]) -> None:
    """Cancel ``task``, wait for it to end, and re-raise whatever ended it other than the cancel.

    It waits through ``asyncio.wait``, so a cancel aimed at the caller stays the caller's: an
    ``except CancelledError: pass`` around ``await task`` would swallow that one too.
    """
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
