"""Signed webhook callbacks: URL safety rules, Standard Webhooks signing and the delivery dispatcher.

The dispatcher lives in `gateway.webhooks.dispatcher` and its command in
`gateway.webhooks.cli` (imported on demand, so ``python -m gateway.webhooks.cli``
runs cleanly).
"""

from gateway.webhooks.safety import Allowlist, WebhookUrlError, check_webhook_url, check_webhook_url_async
from gateway.webhooks.signing import WebhookSecretError, generate_secret, parse_secret

__all__ = [
    "Allowlist",
    "WebhookSecretError",
    "WebhookUrlError",
    "check_webhook_url",
    "check_webhook_url_async",
    "generate_secret",
    "parse_secret",
]
