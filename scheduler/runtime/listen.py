"""Whether a server could listen on an address now: checked before a process spends its start-up (loading a
model, say) on a port it will not get."""

from __future__ import annotations

import errno
import os
import socket

LISTEN_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
"""Why a listener fails to start: the port is taken, the address is not this host's, a privileged port."""


def listen_error(host: str, port: int) -> str | None:
    """Why a server could not listen on `host`:`port` now (bound with SO_REUSEADDR, as aiohttp and redis-server
    bind: a just-closed connection in TIME_WAIT does not hold the port, a listening server does); None if it could.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"cannot listen on {host}:{port}: {e.strerror}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}"
    return None
