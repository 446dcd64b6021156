"""What a Batch API input line that cannot run is told: one clear reason, naming what it got."""

from __future__ import annotations

import json

import msgpack
import pytest

from gateway.openai.batch_lines import LineError, answer_field, parse_line, unpack_error
from gateway.openai.schema import Endpoint

CHAT = Endpoint.CHAT
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(line: str, endpoint: Endpoint = CHAT) -> tuple[str, str]:
    with pytest.raises(LineError) as refused:
        parse_line(line, endpoint)
    return refused.value.code, refused.value.message


def line(**fields: object) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": CHAT.value, "body": BODY, **fields})


@pytest.mark.parametrize(("text", "code", "message"), [
    # The line's own ending is part of it: json's "line 2" would point nowhere in the user's file.
    ('{"custom_id": "a",\r\n', "invalid_json", "the line is not valid JSON: Expecting property name enclosed in "
                                               "double quotes at character 21"),
    ("[1, 2]\n", "invalid_json", "the line must be a JSON object"),
    (line(custom_id=123), "missing_custom_id", "custom_id is required (a non-empty string), got 123"),
    (line(custom_id=""), "missing_custom_id", 'custom_id is required (a non-empty string), got ""'),
    (json.dumps({"url": CHAT.value, "body": BODY}), "missing_custom_id", "custom_id is required (a non-empty string)"),
    (line(method="GET"), "invalid_method", 'method must be POST, got "GET"'),
    (json.dumps({"custom_id": "a", "body": BODY}), "invalid_url",
     "url must be the batch's endpoint /v1/chat/completions; it is missing"),
    (line(url="/v1/embeddings"), "invalid_url",
     'url must be the batch\'s endpoint /v1/chat/completions; got "/v1/embeddings"'),
    (line(body=[1]), "invalid_value", "body: must be a JSON object"),
    (line(body={**BODY, "temperature": -1}), "invalid_value", "body: temperature: must be in [0, 2], got -1"),
    # JSON's escapes can name half a surrogate pair, which no UTF-8 (nor Redis) can carry.
    (line(custom_id="\ud83d"), "invalid_custom_id",
     'custom_id must be Unicode text (it holds a lone surrogate), got "\\ud83d"'),
    # Python's parser takes these; JSON has no such numbers.
    (line()[:-1] + ', "extra": NaN}', "invalid_json", "the line is not valid JSON: NaN is not JSON (numbers are finite)"),
    (line(body={**BODY, "temperature": 1})[:-2] + ', "top_p": -Infinity}}', "invalid_json",
     "the line is not valid JSON: -Infinity is not JSON (numbers are finite)"),
])
def test_a_line_that_cannot_run_says_why_once(text: str, code: str, message: str) -> None:
    assert refusal(text) == (code, message)


def test_a_batch_line_with_several_prompts_is_told_to_split_them_into_lines() -> None:
    text = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"model": "m", "prompt": ["a", "b"]}})
    code, message = refusal(text, Endpoint.COMPLETIONS)
    assert code == "unsupported_parameter" and "put each prompt on a line of its own" in message
    assert "batch" not in message


@pytest.mark.parametrize(("body", "code", "param"), [
    ({**BODY, "tools": [{"type": "function", "function": {"name": "f"}}]}, "unsupported_parameter", "tools"),
    ({**BODY, "top_p": 10**400}, "invalid_value", "top_p"),
    ({**BODY, "messages": [{"role": ["user"], "content": "hi"}]}, "invalid_value", "messages[0].role"),
    ({**BODY, "metadata": {"k": "\ud800"}}, "invalid_value", "metadata.k"),
])
def test_a_request_refused_in_a_line_keeps_the_online_answers_code_and_param(body: dict[str, object], code: str,
                                                                              param: str) -> None:
    """The answer POST /v1/chat/completions gives the same body (a 400 naming the parameter), not a generic one;
    values no check expects (a list for text, an integer past float's range) are refusals like any other."""
    with pytest.raises(LineError) as refused:
        parse_line(line(body=body), CHAT)
    assert (refused.value.code, refused.value.param, refused.value.status) == (code, param, 400)


def test_a_lone_surrogate_quoted_in_an_error_is_kept_escaped() -> None:
    """A body key holding half a surrogate pair is refused like any other unknown key, and so is a model's name
    holding one (by the batch's driver); the refusal, which quotes it, can still be written (msgpack, like Redis,
    takes UTF-8 only)."""
    with pytest.raises(LineError) as refused:
        parse_line(line(body={**BODY, "\ud800x": 1}), CHAT)
    assert refused.value.code == "unsupported_parameter" and "\\ud800x" in refused.value.message
    assert refused.value.param == "\\ud800x"
    unknown_model = LineError("model_not_found", "body: model 'm\udc00' is not served here", param="model",
                              status=404)
    for error in (refused.value, unknown_model):
        assert msgpack.unpackb(error.fields(0)["0"]) == [error.code, error.message]  # type: ignore[arg-type]
    assert unknown_model.message == "body: model 'm\\udc00' is not served here"


def test_an_error_is_kept_so_gateways_before_and_after_read_it() -> None:
    """A rolling upgrade may finalize a batch on a gateway of the version before: the line's own field stays
    [code, message], and what a refused request adds (its param and status) lies in a field beside it."""
    refused = LineError("unsupported_parameter", "body: tools: no", param="tools", status=400)
    fields = refused.fields(7)
    code, message = msgpack.unpackb(fields["7"])  # as a gateway before reads it
    assert (code, message) == ("unsupported_parameter", "body: tools: no")
    again = unpack_error(fields["7"], fields[answer_field(7)])
    assert (again.code, again.message, again.param, again.status) == ("unsupported_parameter", "body: tools: no",
                                                                      "tools", 400)
    # The one form that kept all four in the line's own field, still read.
    four = unpack_error(msgpack.packb(["invalid_value", "body: top_p: no", "top_p", 400]), None)
    assert (four.code, four.param, four.status) == ("invalid_value", "top_p", 400)
    line_fault = LineError("invalid_json", "the line is not valid JSON")
    assert list(line_fault.fields(3)) == ["3"]
    assert unpack_error(line_fault.fields(3)["3"], None).status is None


def test_every_active_batch_is_stepped_first_in_turn() -> None:
    """With the batch lane full, the first batch a round steps takes the slots freed since the last: each round
    starts with the next batch, so every batch (every tenant's) gets its turn at them."""
    from gateway.openai.batch_driver import in_turn

    batches = ["batch_a", "batch_b", "batch_c"]
    firsts = [in_turn(batches, n)[0] for n in range(6)]
    assert firsts == ["batch_a", "batch_b", "batch_c"] * 2
    assert all(sorted(in_turn(batches, n)) == batches for n in range(6)), "each round steps every batch once"
    assert in_turn([], 7) == []
