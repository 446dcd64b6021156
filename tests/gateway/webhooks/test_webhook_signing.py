"""Our signatures verify with the reference `standardwebhooks` package."""

from __future__ import annotations

import base64
import time

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from gateway.webhooks.signing import WebhookSecretError, generate_secret, parse_secret, sign, signed_headers


def test_reference_library_verifies_our_headers() -> None:
    secret = generate_secret()
    body = '{"type":"completed","data":{"text":"héllo"}}'.encode()
    now = int(time.time())
    headers = signed_headers(parse_secret(secret), "msg_abc", now, body, "carpool-webhooks/test")
    assert Webhook(secret).verify(body, headers) == {"type": "completed", "data": {"text": "héllo"}}
    assert headers["content-type"] == "application/json"
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body + b" ", headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(generate_secret()).verify(body, headers)


def test_signature_matches_the_spec_example_construction() -> None:
    key = bytes(range(32))
    secret = "whsec_" + base64.b64encode(key).decode()
    reference = Webhook(secret)
    from datetime import datetime, timezone

    expected = reference.sign("msg_1", datetime.fromtimestamp(1614265330, tz=timezone.utc), '{"a":1}')
    assert sign(key, "msg_1", 1614265330, b'{"a":1}') == expected


@pytest.mark.parametrize("bad", ["", "whsec_", "secret", "whsec_!!!!", "whsec_" + base64.b64encode(b"short").decode()])
def test_bad_secrets_are_refused(bad: str) -> None:
    with pytest.raises(WebhookSecretError, match="webhook secret"):
        parse_secret(bad)


def test_unpadded_secret_is_accepted() -> None:
    key = bytes(range(25))
    encoded = base64.b64encode(key).decode().rstrip("=")
    assert parse_secret("whsec_" + encoded) == key
