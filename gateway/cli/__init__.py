"""The ``carpool`` command (``run``; its verbs in ``gateway.cli.main``): one verb per process kind, the embedded stack of ``carpool up``,
and the clients ``carpool submit`` and ``carpool batch``. ``python -m gateway.cli`` runs it too."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130
"""Ctrl-C, as a shell reports a process ended by SIGINT."""


def run() -> int:
    """The console script's entry point: `gateway.cli.main.main`, imported only here.

    Its imports (aiohttp, redis, every verb's parser) take half a second, during which a Ctrl-C would otherwise
    print a traceback from the script's own import line; here it ends as a Ctrl-C at any later moment does, in one
    line with the shell's exit status. This module imports nothing heavy itself.
    """
    try:
        from gateway.cli.main import main
    except KeyboardInterrupt:
        print("carpool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return main()
