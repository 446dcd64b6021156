"""Whether a server could listen on an address now: checked before a process spends its start-up (loading a
model, say) on a port it will not get."""

from __future__ import annotations

import errno
import os
import socket

LISTEN_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
"""Why a listener fails to start: the port is taken, the address is not this host's, a privileged port."""


def listen_error(host: str, port: int) -> str | None:
    """Why a server could not listen on `host`:`port` now, bound as asyncio binds a server (every address the host
    resolves to, `""` for all interfaces, IPv6 sockets IPv6 only, SO_REUSEADDR: a just-closed connection in
    TIME_WAIT does not hold the port, a listening server does); None if it could."""
    where = f"[{host}]:{port}" if ":" in host else f"{host or '*'}:{port}"
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on {where}: {e.strerror}"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                return f"cannot listen on {where}: {os.strerror(e.errno) if e.errno else e}"
    return None
