"""The job message's webhook.url gets the same shape check wherever a job is read: gateway or worker intake."""

from __future__ import annotations

import json

import msgpack
import pytest

from scheduler.protocol.job import JobSpec, JobValidationError


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://x", "scheme must be http or https, got 'ftp'"),
        ("file:///etc/passwd", "scheme must be http or https"),
        ("http:///nohost", "has no host"),
        ("http://2130706433:8290/hook", "dotted-decimal"),
        ("http://127.1/hook", "dotted-decimal"),
        ("http://a..b/hook", "not a valid host name"),
        ("http://" + "a" * 64 + ".example/hook", "not a valid host name"),
        ("http://example.com:99999/hook", "not a valid URL"),
        ("https://example.com/" + "x" * 3000, "longer than 2048"),
    ],
)
def test_bad_webhook_urls_make_an_invalid_job(url: str, message: str) -> None:
    body = {"id": "j1", "prompt": "x", "webhook": {"url": url}}
    for raw in (json.dumps(body).encode(), msgpack.packb(body)):
        with pytest.raises(JobValidationError) as caught:
            JobSpec.unpack(raw)
        assert caught.value.field == "webhook.url"
        assert message in caught.value.message


@pytest.mark.parametrize("url", ["https://hooks.example/x", "http://192.168.1.1/x", "http://127.0.0.1:8290/hook",
                                 "http://[::1]:8290/hook", "https://bücher.example/hook"])
def test_well_formed_urls_pass_whatever_their_address(url: str) -> None:
    # Which addresses may be called is the deployment's allow-list, checked by the gateway and the dispatcher.
    spec = JobSpec.unpack(msgpack.packb({"id": "j1", "prompt": "x", "webhook": {"url": url}}))
    assert spec.webhook is not None and spec.webhook.url == url
