"""The job message's schema version: the integer 1, or left out."""

from __future__ import annotations

import json

import msgpack
import pytest

from scheduler.protocol.job import JobSpec, JobValidationError


@pytest.mark.parametrize("v", [True, 1.0, "1", 2, 0, None])
def test_only_the_integer_1_is_version_1(v: object) -> None:
    body = {"v": v, "id": "j1", "prompt": "x"}
    for raw in (json.dumps(body).encode(), msgpack.packb(body)):
        with pytest.raises(JobValidationError) as caught:
            JobSpec.unpack(raw)
        assert caught.value.field == "v"
        assert "unsupported schema version" in caught.value.message


def test_version_1_and_a_message_without_one_are_read() -> None:
    for body in ({"v": 1, "id": "j1", "prompt": "x"}, {"id": "j1", "prompt": "x"}):
        assert JobSpec.unpack(msgpack.packb(body)).v == 1
