"""Children of `carpool up` that end with it however it ends (SIGKILL, a crash), on Linux.

Its Redis and its worker run in sessions of their own, so that a terminal's Ctrl-C reaches only up, which then
stops them in order; but a SIGKILL of up stops nothing, and they would run on, holding their ports, so that the
next `carpool up` could not start. Linux's parent-death signal ends them then. It fires when the *thread* that
started the child exits, not the process: start such children from a thread that lives as long as the process
(up's main thread, which also runs its event loop).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when the thread that started it exits."""


def parent_death_hook(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get `sig` when this process (its starting thread) dies; None off Linux.

    libc is loaded here, in the parent: between fork and exec the child only makes the one call.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent_pid = os.getpid()

    def hook() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
            return  # best effort: the child then outlives a killed parent, as without the hook
        if os.getppid() != parent_pid:  # the parent died before the setting took effect: as if it had fired
            os.kill(os.getpid(), sig)

    return hook
