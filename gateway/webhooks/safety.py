"""Which webhook URLs carpool may call: http(s) to public addresses, or to what the operator allow-lists.

A webhook URL comes from whoever submits a job, so without these checks a job
could make the gateway's network call into the operator's own (loopback,
private ranges, cloud metadata at 169.254.169.254). URLs are checked at
submission (`check_webhook_url_async`, which resolves the name) and again at
every delivery, where `VettingResolver` vets the addresses aiohttp is about
to connect to — the same answer is checked and used, so a name that changes
its DNS answer between check and connect gains nothing. The URL's shape
(scheme, host syntax) is checked first, by ``scheduler.protocol.webhook_url``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from scheduler.protocol.webhook_url import HOST_NAME, parse_webhook_url
from scheduler.protocol.webhook_url import WebhookUrlError as WebhookUrlError  # raised by every check here

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Allowlist:
    """Hosts (by name) and networks (CIDR) that webhooks may reach although they are not public."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: str | Iterable[str] | None) -> Allowlist:
        """From ``--webhook-allow``: comma-separated host names, IP addresses or CIDRs."""
        if entries is None:
            return cls()
        if isinstance(entries, str):
            entries = entries.split(",")
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().strip("[]")
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not HOST_NAME.fullmatch(entry):
                    raise WebhookUrlError(f"webhook allow-list: {raw!r} is neither a host name nor an address/CIDR") from None
                hosts.add(_normal_host(entry))
        return cls(frozenset(hosts), tuple(networks))

    def admits_host(self, host: str) -> bool:
        return _normal_host(host) in self.hosts

    def admits_ip(self, ip: IPAddress) -> bool:
        ip = _unmapped(ip)
        return any(ip.version == net.version and ip in net for net in self.networks)


def _normal_host(host: str) -> str:
    return host.lower().rstrip(".")


NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")
"""RFC 6052 well-known prefix: a NAT64 gateway forwards ``64:ff9b::a.b.c.d`` to a.b.c.d."""


def _unmapped(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one leads to, where it embeds one: ``::ffff:10.0.0.1`` (mapped),
    ``64:ff9b::a00:1`` (NAT64) and ``2002:a00:1::`` (6to4) all reach 10.0.0.1."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in NAT64_PREFIX:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return ip


SIX_TO_FOUR_RELAY = ipaddress.ip_network("192.88.99.0/24")
"""The deprecated 6to4 relay anycast block (RFC 7526), which Python still counts as global."""


def is_public(ip: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private, link-local, shared, reserved or multicast. Python counts
    some reserved IPv6 blocks as global: ``::/8``, where the IPv4-compatible (``::10.0.0.1``) and IPv4-translated
    (``::ffff:0:10.0.0.1``) forms and the local-use NAT64 prefix ``64:ff9b:1::/48`` lie, and the deprecated
    site-local ``fec0::/10``; those are refused too."""
    ip = _unmapped(ip)
    if isinstance(ip, ipaddress.IPv6Address) and (ip.is_reserved or ip.is_site_local):
        return False
    return ip.is_global and not ip.is_multicast and not ip.is_unspecified and ip not in SIX_TO_FOUR_RELAY


def check_address(host: str, ip: IPAddress, allow: Allowlist) -> None:
    """Raise unless `ip` (an address `host` names) may be called."""
    if is_public(ip) or allow.admits_ip(ip) or allow.admits_host(host):
        return
    shown = host if host == str(ip) else f"{host} ({ip})"
    raise WebhookUrlError(
        f"webhook.url: {shown} is a non-public address (loopback, private, link-local or reserved); "
        "the operator can admit it with --webhook-allow"
    )


def literal_ip(host: str) -> IPAddress | None:
    """The address a host spells directly; `parse_webhook_url` has refused the legacy IPv4 spellings
    (``2130706433``, ``127.1``), so an IPv4 address here is dotted-decimal."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_webhook_url(url: str, allow: Allowlist) -> None:
    """Checks without DNS: scheme, host present, literal addresses and ``localhost`` names.

    Names are resolved by `check_webhook_url_async`; use that where you can.
    """
    host = parse_webhook_url(url).host
    assert host is not None
    if allow.admits_host(host):
        return
    ip = literal_ip(host)
    if ip is not None:
        check_address(host, ip, allow)
        return
    name = _normal_host(host)
    if name == "localhost" or name.endswith(".localhost"):
        # RFC 6761: these always mean this machine, whatever a resolver says.
        check_address(host, ipaddress.ip_address("127.0.0.1"), allow)


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise WebhookUrlError(f"webhook.url: host {host!r} does not resolve ({e})") from e
    return [ipaddress.ip_address(_address_of(sockaddr).split("%", 1)[0]) for *_, sockaddr in infos]


def _address_of(sockaddr: tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes]) -> str:
    # A host name resolves to IPv4/IPv6 addresses only, whose socket address starts with the address text.
    address = sockaddr[0]
    assert isinstance(address, str), sockaddr
    return address


async def check_webhook_url_async(url: str, allow: Allowlist) -> None:
    """`check_webhook_url`, then every address the host resolves to must be public or allow-listed."""
    check_webhook_url(url, allow)
    parsed = yarl.URL(url)
    host = parsed.host
    assert host is not None and parsed.port is not None
    if allow.admits_host(host) or literal_ip(host) is not None:
        return
    for ip in await resolve_host(host, parsed.port):
        check_address(host, ip, allow)


class VettingResolver(AbstractResolver):
    """An aiohttp resolver that hands out only addresses the webhook rules admit.

    aiohttp connects to exactly the addresses a resolver returns, so vetting
    here pins the connection to what was checked (no DNS-rebinding gap); the
    URL's host name still goes into the Host header and TLS SNI.
    """

    def __init__(self, allow: Allowlist) -> None:
        self._allow = allow
        self._inner = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            check_address(host, ipaddress.ip_address(result["host"]), self._allow)
        return results

    async def close(self) -> None:
        await self._inner.close()
