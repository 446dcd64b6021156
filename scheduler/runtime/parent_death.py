"""A child process that ends with its parent however the parent ends (SIGKILL, a crash), on Linux.

`carpool up` starts its Redis and its worker in sessions of their own, so that a terminal's Ctrl-C reaches only
up, which then stops them in order; a worker starts its engine process. A SIGKILL of the parent stops none of
them, and they would run on, holding their ports or their GPU. Linux's parent-death signal ends them then. It
fires when the *thread* that started the child exits, not the process: start such children from a thread that
lives as long as the process (up's main thread, which also runs its event loop).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when the thread that started it exits."""


def die_with_parent(sig: signal.Signals, parent_pid: int) -> Callable[[], None] | None:
    """A function that, called in the child, has it get `sig` when its parent (`parent_pid`) dies, and at once if
    the parent died before the setting took effect; None off Linux, or where libc offers no prctl.

    libc is loaded here, in the caller: as a ``preexec_fn`` (between fork and exec) the function makes one call.
    Best effort: where the call fails, the child outlives a killed parent, as without it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
            return
        if os.getppid() != parent_pid:  # the parent died before the setting took effect: as if it had fired
            os.kill(os.getpid(), sig)

    return arm
