"""The check a process makes before its start-up: could a server listen there now, bound as asyncio binds one."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from scheduler.runtime.listen import listen_error


@pytest.fixture
def taken_on_every_ipv4_address() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        yield server.getsockname()[1]


def test_a_port_a_server_listens_on_is_refused_with_the_reason(taken_on_every_ipv4_address: int) -> None:
    port = taken_on_every_ipv4_address
    assert listen_error("127.0.0.1", port) == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    # "" is every interface, as asyncio takes it: the IPv4 ones are taken.
    assert listen_error("", port) == f"cannot listen on *:{port}: Address already in use"
    assert listen_error("127.0.0.1", 0) is None


@pytest.mark.skipif(not socket.has_ipv6, reason="this machine has no IPv6")
def test_ipv6_is_checked_on_its_own_as_asyncio_binds_it(taken_on_every_ipv4_address: int) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback address here")
    # asyncio binds IPv6 sockets IPv6-only, so an IPv4 listener leaves the port free there.
    assert listen_error("::", taken_on_every_ipv4_address) is None
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert listen_error("::1", port) == f"cannot listen on [::1]:{port}: Address already in use"


def test_a_host_that_does_not_resolve_is_named() -> None:
    problem = listen_error("no-such-host.invalid", 8000)
    assert problem is not None and problem.startswith("cannot listen on no-such-host.invalid:8000: "), problem
