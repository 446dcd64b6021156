"""The shape of a webhook URL: what can be checked without DNS, the allow-list or the network.

The gateway (at submission), the worker (at intake of a lane entry) and the
dispatcher (before every attempt) all apply `parse_webhook_url`, so a URL one
of them accepts is one the others accept and the dispatcher's HTTP client can
send to. Which addresses may be called is decided in ``gateway.webhooks.safety``.
"""

from __future__ import annotations

import ipaddress
import re
import socket

import yarl

ALLOWED_SCHEMES = ("http", "https")
MAX_URL_LEN = 2048
HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9])?)*\.?")
"""A DNS host name (in its ASCII form): dot-separated labels of letters, digits, ``-`` and ``_``."""
MAX_LABEL_LEN = 63
"""Longest label of a DNS name, in characters (RFC 1035); a longer one cannot even be looked up."""


class WebhookUrlError(ValueError):
    """A webhook URL carpool refuses to call; the message says why."""


def parse_webhook_url(url: str) -> yarl.URL:
    """Parse and check what can be checked without DNS; raise `WebhookUrlError` otherwise.

    The host must be a host name, a bracketed IPv6 address or an IPv4 address in dotted-decimal form
    (``a.b.c.d``): the legacy spellings ``2130706433``, ``0x7f000001``, ``127.1`` or ``0177.0.0.1`` are
    refused, because the HTTP client refuses to connect to them.
    """
    if not isinstance(url, str) or not url:
        raise WebhookUrlError("webhook.url: required")
    if len(url) > MAX_URL_LEN:
        raise WebhookUrlError(f"webhook.url: longer than {MAX_URL_LEN} characters")
    try:
        parsed = yarl.URL(url)
        port = parsed.port
    except (ValueError, TypeError) as e:
        raise WebhookUrlError(f"webhook.url: not a valid URL ({e})") from e
    if parsed.scheme not in ALLOWED_SCHEMES:
        raise WebhookUrlError(f"webhook.url: scheme must be http or https, got {parsed.scheme or 'none'!r}")
    host = parsed.raw_host
    if not host or port is None:
        raise WebhookUrlError("webhook.url: has no host")
    if port == 0:
        raise WebhookUrlError("webhook.url: port 0 cannot be connected to")
    _check_host(host)
    return parsed


def _check_host(host: str) -> None:
    if ":" in host:  # yarl took it from brackets: it must be an IPv6 address
        try:
            ipaddress.IPv6Address(host)
        except ValueError as e:
            raise WebhookUrlError(f"webhook.url: host [{host}] is not a valid IPv6 address") from e
        return
    if _is_ipv4_spelling(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError as e:
            raise WebhookUrlError(
                f"webhook.url: host {host!r} is not a dotted-decimal IPv4 address; write it as a.b.c.d"
            ) from e
        return
    if not HOST_NAME.fullmatch(host) or any(len(label) > MAX_LABEL_LEN for label in host.split(".")):
        raise WebhookUrlError(f"webhook.url: host {host!r} is not a valid host name")


def _is_ipv4_spelling(host: str) -> bool:
    """Whether `host` reads as an IPv4 address: all digits and dots, or a form ``inet_aton`` maps to one."""
    if host.replace(".", "").isdigit():
        return True
    if not host[0].isdigit() or not all(c in "0123456789abcdefx." for c in host.lower()):
        return False
    try:
        socket.inet_aton(host)
    except OSError:
        return False
    return True
