"""Webhook address checks see through IPv6 addresses that carry an IPv4 one (mapped, compatible, translated,
NAT64, 6to4), and refuse the reserved IPv6 blocks that Python counts as global."""

from __future__ import annotations

import pytest

from gateway.webhooks.safety import Allowlist, WebhookUrlError, check_webhook_url


@pytest.mark.parametrize("host", [
    "[::ffff:127.0.0.1]", "[64:ff9b::7f00:1]", "[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::1]", "[2002:a9fe:a9fe::]",
    "[64:ff9b::a00:1]",
    # IPv4-compatible and IPv4-translated forms, the local-use NAT64 prefix, site-local, the 6to4 relay block.
    "[::10.0.0.1]", "[::127.0.0.1]", "[::ffff:0:a00:1]", "[::ffff:0:a9fe:a9fe]", "[64:ff9b:1::a00:1]",
    "[64:ff9b:1::a9fe:a9fe]", "[fec0::1]", "192.88.99.1",
])
def test_ipv6_forms_of_non_public_ipv4_are_refused(host):
    with pytest.raises(WebhookUrlError, match="non-public"):
        check_webhook_url(f"http://{host}/hook", Allowlist())


@pytest.mark.parametrize("host", ["[64:ff9b::808:808]", "[2002:808:808::1]", "[2606:4700:4700::1111]", "8.8.8.8"])
def test_public_addresses_still_pass(host):
    check_webhook_url(f"https://{host}/hook", Allowlist())


def test_allow_listed_network_admits_its_nat64_form():
    check_webhook_url("http://[64:ff9b::a00:5]/hook", Allowlist.parse("10.0.0.0/8"))
