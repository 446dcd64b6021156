"""A Redis outage is logged at most once in a while for each place that meets it, with what was left out."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from scheduler.runtime.outage_log import OutageLog


def test_each_place_says_an_outage_once_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    outages = OutageLog(logging.getLogger("outage-test"), retry_s=0.5, every_s=30.0, clock=lambda: now[0])
    error = RedisConnectionError("Connection refused")
    with caplog.at_level(logging.WARNING, logger="outage-test"):
        for _ in range(60):  # 30 s of retries every 0.5 s, from two places
            outages.warn("heartbeat", error)
            outages.warn("commits", error, "job j1 waits to be written")
            now[0] += 0.5
        outages.warn("heartbeat", error)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "heartbeat: Redis unavailable (Connection refused); retrying every 0.5s, said again at most every 30s",
        "commits (job j1 waits to be written): Redis unavailable (Connection refused); retrying every 0.5s, "
        "said again at most every 30s",
        "heartbeat: Redis unavailable (Connection refused); retrying every 0.5s, said again at most every 30s; "
        "59 more such since the last of these",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_the_end_of_an_outage_is_said_once_and_a_new_one_once_it_lasts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    outages = OutageLog(logging.getLogger("outage-test"), retry_s=0.5, every_s=30.0, clock=lambda: now[0])
    error = RedisConnectionError("Connection refused")
    with caplog.at_level(logging.INFO, logger="outage-test"):
        outages.recovered()  # no outage: nothing to say
        for _ in range(20):  # 10 s down
            outages.warn("heartbeat", error)
            now[0] += 0.5
        outages.recovered()
        outages.recovered()
        now[0] += 5.0
        outages.warn("heartbeat", error)  # a new outage 5 s later that ends at once: within the interval, counted
        outages.recovered()  # and its end not said, as its start was not
        now[0] += 5.0
        for _ in range(4):  # another, 10 s after the first ended, that lasts: said once it has lasted 4 retries
            outages.warn("heartbeat", error)
            now[0] += 0.5
        outages.warn("heartbeat", error)
        outages.recovered()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "heartbeat: Redis unavailable (Connection refused); retrying every 0.5s, said again at most every 30s",
        "Redis available again, 10s after it was first found unavailable (19 warnings left out)",
        "heartbeat: Redis unavailable (Connection refused); retrying every 0.5s, said again at most every 30s; "
        "5 more such since the last of these",
        "Redis available again, 2s after it was first found unavailable",
    ]


def test_a_redis_that_fails_some_writes_and_takes_others_is_said_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At maxmemory a step's writes fail while other calls succeed: an outage ends and starts five times a second."""
    now = [0.0]
    outages = OutageLog(logging.getLogger("outage-test"), retry_s=0.5, every_s=30.0, clock=lambda: now[0])
    error = RedisConnectionError("OOM command not allowed when used memory > 'maxmemory'")
    with caplog.at_level(logging.INFO, logger="outage-test"):
        for _ in range(300):  # 60 s
            outages.warn("step writes", error)
            now[0] += 0.1
            outages.recovered()
            now[0] += 0.1
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages  # a warning and its end, twice a minute
    assert messages[2].endswith("; 149 more such since the last of these"), messages
