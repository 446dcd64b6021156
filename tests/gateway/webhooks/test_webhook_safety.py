"""Webhook URL rules: only http(s) to public addresses unless allow-listed; refusal before any connection."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.webhooks.safety import (
    Allowlist,
    VettingResolver,
    WebhookUrlError,
    check_webhook_url,
    check_webhook_url_async,
    is_public,
)

NO_ALLOW = Allowlist()

REFUSED = [
    "http://10.0.0.1/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://localhost/hook",
    "http://LocalHost.:8080/hook",
    "http://api.localhost/hook",
    "http://[::1]/hook",
    "http://0.0.0.0/hook",
    "http://127.0.0.1:9/hook",
    "http://192.168.1.10/hook",
    "http://172.16.0.1/hook",
    "http://100.64.0.1/hook",
    "http://[fe80::1]/hook",
    "http://[fd00::1]/hook",
    "http://[::ffff:10.0.0.1]/hook",
    "http://[::ffff:169.254.169.254]/hook",
    "http://224.0.0.1/hook",
]

LEGACY_IPV4 = ["2130706433", "0x7f000001", "0X7F000001", "127.1", "127.0.1", "0177.0.0.1", "017700000001",
               "127.0.0.01", "127.0.0.1."]
"""Spellings of 127.0.0.1 that ``inet_aton`` reads but the dispatcher's HTTP client does not connect to."""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket on 127.0.0.1 that records whether anyone connected."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def assert_no_connection(sock: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        sock.accept()


def hosts_file_loopback_name() -> str | None:
    """A name other than localhost that /etc/hosts maps to a loopback address, if there is one."""
    path = Path("/etc/hosts")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) < 2:
            continue
        try:
            is_loopback = ipaddress.ip_address(parts[0]).is_loopback
        except ValueError:
            continue
        for name in parts[1:]:
            if is_loopback and "localhost" not in name.lower():
                return name
    return None


@pytest.mark.parametrize("url", REFUSED)
async def test_non_public_addresses_are_refused(url: str) -> None:
    with pytest.raises(WebhookUrlError, match="non-public"):
        check_webhook_url(url, NO_ALLOW)
    with pytest.raises(WebhookUrlError, match="non-public"):
        await check_webhook_url_async(url, NO_ALLOW)


@pytest.mark.parametrize("host", LEGACY_IPV4)
async def test_legacy_ipv4_spellings_are_refused_even_when_the_address_is_allowed(host: str) -> None:
    allow = Allowlist.parse("127.0.0.1")
    with pytest.raises(WebhookUrlError, match="dotted-decimal"):
        check_webhook_url(f"http://{host}:8290/hook", allow)
    with pytest.raises(WebhookUrlError, match="dotted-decimal"):
        await check_webhook_url_async(f"http://{host}:8290/hook", NO_ALLOW)


async def test_every_url_the_check_admits_the_dispatchers_client_can_send() -> None:
    """Each spelling of an allow-listed address is either refused by the check or reaches the receiver."""
    hits: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        hits.append(request.host)
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    allow = Allowlist.parse("127.0.0.1")
    admitted = []
    try:
        connector = aiohttp.TCPConnector(resolver=VettingResolver(allow), use_dns_cache=False)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            for host in ["127.0.0.1", "[::ffff:127.0.0.1]", *LEGACY_IPV4]:
                url = f"http://{host}:{port}/hook"
                try:
                    await check_webhook_url_async(url, allow)
                except WebhookUrlError:
                    continue
                admitted.append(host)
                async with session.post(url, data=b"{}") as resp:
                    assert resp.status == 204, url
    finally:
        await runner.cleanup()
    assert admitted == ["127.0.0.1", "[::ffff:127.0.0.1]"] and len(hits) == 2


@pytest.mark.parametrize("url", ["http://a..b/hook", "http://ex ample.com/hook", "http://-a.example/hook",
                                 "http://[::1/hook", "http://example.com:99999/hook", "http://999.1.1.1/hook"])
def test_malformed_hosts_are_refused(url: str) -> None:
    with pytest.raises(WebhookUrlError, match="webhook.url"):
        check_webhook_url(url, Allowlist.parse("0.0.0.0/0"))


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x", "gopher://example.com/", "//example.com/x"])
def test_only_http_and_https(url: str) -> None:
    with pytest.raises(WebhookUrlError, match="scheme must be http or https"):
        check_webhook_url(url, NO_ALLOW)


@pytest.mark.parametrize("url", ["", "http:///nohost", "x" * 3000])
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(WebhookUrlError, match="webhook.url"):
        check_webhook_url(url, NO_ALLOW)


def test_public_addresses_pass_the_static_check() -> None:
    check_webhook_url("https://93.184.216.34/hook", NO_ALLOW)
    check_webhook_url("https://example.com/hook", NO_ALLOW)
    check_webhook_url("http://[2606:4700::6810:85e5]:8443/x", NO_ALLOW)
    assert is_public(ipaddress.ip_address("8.8.8.8")) and not is_public(ipaddress.ip_address("198.18.0.1"))


async def test_a_name_resolving_to_loopback_is_refused(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    name = hosts_file_loopback_name()
    if name is not None:
        with pytest.raises(WebhookUrlError, match="non-public"):
            await check_webhook_url_async(f"http://{name}:{port}/hook", NO_ALLOW)
    resolver = VettingResolver(NO_ALLOW)
    with pytest.raises(WebhookUrlError, match="non-public"):
        await resolver.resolve("localhost", port)
    # Through a real aiohttp session: the resolver refuses before a socket is opened.
    connector = aiohttp.TCPConnector(resolver=VettingResolver(NO_ALLOW), use_dns_cache=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        for host in filter(None, ["localhost", name]):
            with pytest.raises(WebhookUrlError):
                await session.post(f"http://{host}:{port}/hook", data=b"{}")
    assert_no_connection(listener)


async def test_unresolvable_name_is_refused() -> None:
    with pytest.raises(WebhookUrlError, match="does not resolve"):
        await check_webhook_url_async("https://no-such-host.invalid/hook", NO_ALLOW)


async def test_allow_list_admits_hosts_and_networks() -> None:
    allow = Allowlist.parse("127.0.0.1, 10.0.0.0/8,hooks.internal,localhost,[::1]")
    for url in ["http://127.0.0.1:9/h", "http://10.1.2.3/h", "http://hooks.internal/h", "http://localhost:9/h",
                "http://[::1]:9/h", "http://[::ffff:10.0.0.1]/h"]:
        check_webhook_url(url, allow)
    await check_webhook_url_async("http://localhost:9/h", allow)
    with pytest.raises(WebhookUrlError):
        check_webhook_url("http://169.254.169.254/", allow)
    with pytest.raises(WebhookUrlError):
        check_webhook_url("http://192.168.0.1/", allow)
    # 127.0.0.1 is admitted by address, so a name that resolves to it passes the DNS check too.
    only_ip = Allowlist.parse(["127.0.0.1"])
    assert [r["host"] for r in await VettingResolver(only_ip).resolve("localhost", 80)] == ["127.0.0.1"]


@pytest.mark.parametrize("entry", ["http://x/", "a b", "10.0.0.0/33"])
def test_bad_allow_list_entries(entry: str) -> None:
    with pytest.raises(WebhookUrlError, match="allow-list"):
        Allowlist.parse(entry)
