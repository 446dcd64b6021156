"""The job message's schema version: the integer 1, or left out."""

from __future__ import annotations

import json

import msgpack
import pytest

from scheduler.protocol.job import JobSpec, JobValidationError


@pytest.mark.parametrize("v", [True, 1.0, "1", 2, 0])
def test_only_the_integer_1_is_version_1(v: object) -> None:
    body = {"v": v, "id": "j1", "prompt": "x"}
    for raw in (json.dumps(body).encode(), msgpack.packb(body)):
        with pytest.raises(JobValidationError) as caught:
            JobSpec.unpack(raw)
        assert caught.value.field == "v"
        assert "unsupported schema version" in caught.value.message


def test_version_1_and_a_message_without_one_are_read() -> None:
    for body in ({"v": 1, "id": "j1", "prompt": "x"}, {"id": "j1", "prompt": "x"}, {"v": None, "id": "j1", "prompt": "x"}):
        assert JobSpec.unpack(msgpack.packb(body)).v == 1


@pytest.mark.parametrize("lead", [b" ", b"\n", b"\r\n\t ", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n"])
def test_a_json_job_after_whitespace_or_a_byte_order_mark_is_read_as_json(lead: bytes) -> None:
    """What an editor or `echo` leaves before the object: no msgpack map starts with those bytes."""
    spec = JobSpec.unpack(lead + json.dumps({"id": "j1", "prompt": "x"}).encode())
    assert (spec.id, spec.prompt) == ("j1", "x")
    with pytest.raises(JobValidationError, match="starts with '{' but is not valid JSON"):
        JobSpec.unpack(lead + b'{"id": "j1", ')


def test_a_message_neither_json_nor_msgpack_says_why_also_when_msgpack_gives_no_message() -> None:
    nested = b"\x91" * 200_000 + b"\x90"  # an array in an array ... past any parser's depth
    with pytest.raises(JobValidationError) as caught:
        JobSpec.unpack(nested)
    assert caught.value.message.rstrip(")").split("(msgpack: ")[1].strip()


@pytest.mark.parametrize(("raw", "kind"), [(b"[1, 2]", "an array"), (b'"hello"', "a string"), (b"5", "a number"),
                                         (b"12.5", "a number"), (b"true", "true or false"), (b"null", "null")])
def test_json_that_is_no_object_is_named_as_json(raw: bytes, kind: str) -> None:
    """What redis-cli producers send by mistake: named as the JSON it is, not as msgpack that went wrong."""
    with pytest.raises(JobValidationError) as caught:
        JobSpec.unpack(raw)
    assert caught.value.message == f"must be a msgpack map or a JSON object; it is JSON, but {kind}, not an object"
    with pytest.raises(JobValidationError, match=f"it is JSON, but {kind}, not an object"):
        JobSpec.unpack(b"\xef\xbb\xbf" + raw)
    # A msgpack value other than a map is still named as msgpack.
    with pytest.raises(JobValidationError, match="it is a msgpack list"):
        JobSpec.unpack(msgpack.packb([1, 2]))


def test_odd_values_are_named_in_the_senders_terms() -> None:
    """A msgpack extension type is named as such (not walked into as the list msgpack hands it over as), an
    over-long JSON integer without Python's advice about the server's settings, deep msgpack as nesting."""
    with pytest.raises(JobValidationError) as caught:
        JobSpec.unpack(msgpack.packb({"id": "j1", "prompt": "x", "metadata": {"x": msgpack.ExtType(5, b"ab")}}))
    assert caught.value.field == "metadata.x" and "msgpack extension type" in caught.value.message
    with pytest.raises(JobValidationError) as caught:
        JobSpec.unpack(b'{"id": "j1", "prompt": "x", "seed": ' + b"9" * 5000 + b"}")
    assert "too many digits" in caught.value.message and "sys." not in caught.value.message
    with pytest.raises(JobValidationError, match=r"\(msgpack: nested too deeply\)"):
        JobSpec.unpack(b"\x91" * 200_000 + b"\x90")


@pytest.mark.parametrize(("ids", "field", "message"), [
    ([1, True, 2], "prompt_token_ids", "every token id must be a non-negative integer"),
    ([1, -1], "prompt_token_ids", "every token id must be a non-negative integer"),
    ([1, 2.0], "prompt_token_ids", "every token id must be a non-negative integer"),
    ([1, 2**64], "prompt_token_ids[1]", "integer out of the 64-bit range"),
    ([3] * 100_000 + ["x"], "prompt_token_ids", "every token id must be a non-negative integer"),
])
def test_token_ids_are_checked_whole_and_the_odd_one_named(ids: list[object], field: str, message: str) -> None:
    """Long lists of ids are checked in one pass; what is wrong is named as for a short one."""
    with pytest.raises(JobValidationError) as caught:
        JobSpec.from_wire({"id": "j1", "prompt_token_ids": ids})
    assert (caught.value.field, caught.value.message) == (field, message)
    assert JobSpec.from_wire({"id": "j1", "prompt_token_ids": [0, 5, 2**63]}).prompt_token_ids == [0, 5, 2**63]


def test_a_field_sent_as_null_is_that_field_left_out() -> None:
    """For the schema version, the id (a fresh one where the caller gives a default), the lane and priority as
    for params, deadline, metadata, tenant and traceparent; a value no field takes is still refused."""
    spec = JobSpec.from_wire({"v": None, "id": None, "prompt": "x", "lane": None, "priority": None, "deadline": None,
                              "params": None, "metadata": None, "tenant": None, "traceparent": None},
                             default_id="fresh")
    assert (spec.v, spec.id, spec.lane.value, spec.priority) == (1, "fresh", "standard", 0)
    with pytest.raises(JobValidationError, match="required"):
        JobSpec.from_wire({"id": None, "prompt": "x"})  # no default: a lane entry must name its job
    for field, value in (("lane", "urgent"), ("priority", "high"), ("priority", 1001)):
        with pytest.raises(JobValidationError) as caught:
            JobSpec.from_wire({"id": "j1", "prompt": "x", field: value})
        assert caught.value.field == field


def test_a_message_keyed_by_a_number_is_told_its_keys_must_be_strings() -> None:
    with pytest.raises(JobValidationError) as caught:
        JobSpec.unpack(msgpack.packb({"id": "j1", "prompt": "x", 1: "one"}))
    assert (caught.value.field, caught.value.message) == ("body", "map keys must be strings, got int 1")
