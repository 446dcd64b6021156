"""Pure webhook policy: payload, delivery entry, event filter, throttle, retry decisions, config."""

from __future__ import annotations

import json

import pytest

from gateway.webhooks.config import WebhookConfig
from gateway.webhooks.signing import generate_secret
from scheduler.protocol.webhooks import (
    DEFAULT_MAX_ATTEMPTS,
    AttemptOutcome,
    OutputThrottle,
    RetryPolicy,
    decide,
    delivery_fields,
    parse_retry_after,
    should_send,
)


def test_delivery_fields_fix_the_body_at_enqueue() -> None:
    data = {"id": "job1", "status": "succeeded", "output": {"text": "héllo"}}
    fields = delivery_fields("job1", "completed", "https://example.com/h", data, now=1700000000.25)
    assert fields["id"].startswith(b"msg_") and len(fields["id"]) == 36
    assert fields["job_id"] == b"job1" and fields["event"] == b"completed" and fields["url"] == b"https://example.com/h"
    body = json.loads(fields["payload"])
    assert body == {"type": "completed", "timestamp": "2023-11-14T22:13:20.250Z", "data": data}
    other = delivery_fields("job1", "completed", "https://example.com/h", data, now=1700000000.25)
    assert other["id"] != fields["id"]
    with pytest.raises(ValueError):
        delivery_fields("job1", "finished", "https://example.com/h", data, now=0.0)


def test_should_send_filters_by_the_jobs_events() -> None:
    assert should_send(None, "output")
    assert should_send(["started", "completed"], "completed")
    assert not should_send(["started", "completed"], "output")


def test_output_throttle_allows_two_a_second() -> None:
    throttle = OutputThrottle()
    sent = [t / 10 for t in range(30) if throttle.should_emit(t / 10)]
    assert sent == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


def test_backoff_follows_the_schedule_within_jitter() -> None:
    policy = RetryPolicy()
    assert DEFAULT_MAX_ATTEMPTS == 8
    assert [policy.backoff_s(n, 0.5) for n in range(1, 10)] == [5, 30, 120, 600, 1800, 3600, 7200, 7200, 7200]
    assert policy.backoff_s(1, 0.0) == pytest.approx(4.0) and policy.backoff_s(1, 0.999999) == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("attempt", "status", "error", "retry_after", "outcome", "delay"),
    [
        (1, 200, None, None, AttemptOutcome.DELIVERED, None),
        (3, 204, None, None, AttemptOutcome.DELIVERED, None),
        (1, 410, None, None, AttemptOutcome.GONE, None),
        (1, 500, None, None, AttemptOutcome.RETRYING, 0.1),
        (2, None, "timed out", None, AttemptOutcome.RETRYING, 0.2),
        (1, 429, None, 7.0, AttemptOutcome.RETRYING, 7.0),
        (1, 503, None, 99999.0, AttemptOutcome.RETRYING, 60.0),
        (1, 500, None, 7.0, AttemptOutcome.RETRYING, 0.1),  # Retry-After only counts on 429/503
        (1, 301, None, None, AttemptOutcome.RETRYING, 0.1),  # redirects are not followed
        (3, 500, None, None, AttemptOutcome.DEAD, None),
        (3, 429, None, 1.0, AttemptOutcome.DEAD, None),
        (1, 503, None, 0.0, AttemptOutcome.RETRYING, 0.1),  # Retry-After never shortens the schedule
        (2, 429, None, 0.05, AttemptOutcome.RETRYING, 0.2),
    ],
)
def test_decide(attempt, status, error, retry_after, outcome, delay) -> None:
    policy = RetryPolicy(schedule_s=(0.1, 0.2), max_attempts=3, jitter_fraction=0.0, max_retry_after_s=60.0)
    decision = decide(policy, attempt, status, error, retry_after, 0.5)
    assert decision.outcome is outcome
    assert decision.delay_s == (None if delay is None else pytest.approx(delay))
    if outcome is AttemptOutcome.DEAD:
        assert "attempt 3 of 3" in (decision.reason or "")


@pytest.mark.parametrize("retry_after", ["0", "Thu, 01 Jan 1970 00:00:01 GMT"])
def test_retry_after_zero_or_past_keeps_the_default_schedule(retry_after: str) -> None:
    policy = RetryPolicy()
    now = 1_767_268_800.0
    delays = []
    for attempt in range(1, policy.max_attempts + 1):
        decision = decide(policy, attempt, 503, None, parse_retry_after(retry_after, now=now), 0.5)
        delays.append(decision.delay_s)
    assert delays == [5, 30, 120, 600, 1800, 3600, 7200, None]
    assert sum(d for d in delays if d is not None) > 3.5 * 3600  # "about four hours"


def test_retry_after_lengthens_up_to_its_cap_but_never_below_the_schedule() -> None:
    policy = RetryPolicy(schedule_s=(5.0, 7200.0), jitter_fraction=0.0, max_retry_after_s=3600.0)
    assert decide(policy, 1, 429, None, 60.0, 0.5).delay_s == 60.0
    assert decide(policy, 1, 429, None, 99999.0, 0.5).delay_s == 3600.0
    assert decide(policy, 2, 429, None, 99999.0, 0.5).delay_s == 7200.0  # the cap does not shorten the schedule
    assert decide(policy, 2, 503, None, 1.0, 0.5).delay_s == 7200.0


def test_a_refused_url_is_dead_at_the_first_attempt() -> None:
    decision = decide(RetryPolicy(), 1, None, "refused: webhook.url: scheme must be http or https, got 'ftp'", None,
                      0.5, is_refused=True)
    assert decision.outcome is AttemptOutcome.DEAD and decision.delay_s is None
    assert decision.reason is not None and "scheme must be http or https" in decision.reason


def test_parse_retry_after() -> None:
    assert parse_retry_after("120", now=0.0) == 120.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now=40.0) == 60.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now=400.0) == 0.0
    assert parse_retry_after("soon", now=0.0) is None and parse_retry_after(None, now=0.0) is None
    # RFC 9110's delay-seconds are ASCII digits: Python's isdigit() also takes other scripts' digits and more.
    assert parse_retry_after("\u0661\u0662", now=0.0) is None and parse_retry_after("\u00b2", now=0.0) is None


def test_config_builds_policy_and_rejects_bad_values() -> None:
    config = WebhookConfig(webhook_secret=generate_secret(), webhook_retry_schedule_s=[0.1, 0.2, 0.3], webhook_jitter=0)
    assert config.retry_policy().max_attempts == 4
    assert config.signing_key() is not None and len(config.signing_key() or b"") == 32
    with pytest.raises(ValueError, match="whsec_"):
        WebhookConfig(webhook_secret="hunter2")
    with pytest.raises(ValueError, match="allow-list"):
        WebhookConfig(webhook_allow=["http://x/"])
    with pytest.raises(ValueError, match="schedule"):
        WebhookConfig(webhook_retry_schedule_s=[])
