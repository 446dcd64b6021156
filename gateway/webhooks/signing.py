"""Standard Webhooks signatures: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"
MIN_SECRET_BYTES = 24


class WebhookSecretError(ValueError):
    """The configured signing secret is not a usable ``whsec_…`` value."""


def parse_secret(secret: str) -> bytes:
    """The HMAC key inside a ``whsec_<base64>`` secret."""
    if not secret.startswith(SECRET_PREFIX):
        raise WebhookSecretError(f"webhook secret: must start with {SECRET_PREFIX!r} followed by base64")
    encoded = secret[len(SECRET_PREFIX):]
    try:
        # Unpadded base64 is common in the wild; extra padding is ignored by the decoder.
        key = base64.b64decode(encoded + "==", validate=False)
        if base64.b64encode(key).rstrip(b"=") != encoded.encode().rstrip(b"="):
            raise ValueError("not canonical base64")
    except (binascii.Error, ValueError) as e:
        raise WebhookSecretError("webhook secret: the part after 'whsec_' is not valid base64") from e
    if len(key) < MIN_SECRET_BYTES:
        raise WebhookSecretError(f"webhook secret: needs at least {MIN_SECRET_BYTES} random bytes, got {len(key)}")
    return key


def generate_secret() -> str:
    """A fresh ``whsec_`` secret with 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one attempt."""
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(key: bytes, msg_id: str, timestamp: int, body: bytes, user_agent: str) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(key, msg_id, timestamp, body),
        "content-type": "application/json",
        "user-agent": user_agent,
    }
