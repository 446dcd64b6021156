"""OpenAI request bodies turned into job params: what OpenAI takes, carpool takes too."""

from __future__ import annotations

import pytest

from gateway.errors import OpenAIError
from gateway.openai.responses import openai_param, renamed_in
from gateway.openai.schema import Endpoint, parse_request
from scheduler.params import MAX_SEED
from scheduler.protocol.lanes import Lane


def _params(**body: object) -> dict[str, object]:
    request = parse_request(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
                            default_lane=Lane.INTERACTIVE)
    return dict(request.jobs[0]["params"])


@pytest.mark.parametrize(("seed", "drawn_as"), [(7, 7), (-1, MAX_SEED), (-(MAX_SEED + 1), 0), (MAX_SEED, MAX_SEED)])
def test_any_64_bit_seed_is_taken(seed: int, drawn_as: int) -> None:
    assert _params(seed=seed)["seed"] == drawn_as


def test_a_seed_past_64_bits_is_refused() -> None:
    with pytest.raises(OpenAIError, match="seed"):
        _params(seed=-(MAX_SEED + 2))


def test_top_p_zero_is_taken() -> None:
    assert _params(top_p=0)["top_p"] == 0


def test_a_message_sent_back_as_the_client_dumped_it_is_taken() -> None:
    """`model_dump()` of a returned message holds refusal, audio, tool_calls... at null; an assistant's content
    may be null. Null keys are left out, as at the top level; a key with a value stays refused."""
    dumped = {"role": "assistant", "content": "red, green", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    messages = [{"role": "user", "content": "colours?"}, dumped, {"role": "assistant", "content": None},
                {"role": "user", "content": "more"}]
    request = parse_request(Endpoint.CHAT, {"model": "m", "messages": messages}, default_lane=Lane.INTERACTIVE)
    assert [m["content"] for m in request.jobs[0]["messages"]] == ["colours?", "red, green", "", "more"]
    with pytest.raises(OpenAIError, match="refusal"):
        parse_request(Endpoint.CHAT, {"model": "m", "messages": [{**dumped, "refusal": "no"}]},
                      default_lane=Lane.INTERACTIVE)
    with pytest.raises(OpenAIError, match="content"):
        parse_request(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": None}]},
                      default_lane=Lane.INTERACTIVE)


@pytest.mark.parametrize(("parts", "offsets"), [
    ([b"w", b"\xef\xbf\xbd", b"p", b"\xf4", b"("], [0, 1, 2, 3, 4]),  # a lead byte nothing completes: its own U+FFFD
    ([b"S", b"A", b"\xf4", b"@"], [0, 1, 2, 3]),
    ([b"a", b"\xe8", b"\xbc\x96", b"b"], [0, 1, 1, 2]),  # one character over two tokens: both start where it does
    ([b"a", b"\xef\xbf", b"\xbd", b"c"], [0, 1, 1, 2]),  # a real U+FFFD split the same way
    ([b"a", b"\xf4\x8f", b"x"], [0, 1, 2]),
    # A character cut short after its second byte is one U+FFFD: that byte's token starts inside it.
    ([b"\xe9", b"\xa9", b"\xc1", b"\x86", b"R"], [0, 0, 1, 2, 3]),
    ([b"\xf0", b"\x9f", b"\x98", b"!"], [0, 0, 0, 1]),
])
def test_text_offsets_follow_the_text_also_around_bytes_that_are_not_utf8(parts: list[bytes],
                                                                           offsets: list[int]) -> None:
    from gateway.openai.responses import completion_logprobs

    text = b"".join(parts).decode("utf-8", "replace")
    entries = [{"token": f"bytes:{p!r}", "bytes": list(p), "logprob": -1.0} for p in parts]
    assert completion_logprobs(entries, text)["text_offset"] == offsets, text


def test_a_special_token_takes_no_place_in_the_texts_offsets() -> None:
    """A special token sampled mid-output (a BOS, a chat marker) is left out of the text, though its entry shows
    its piece: the tokens after it start where the text goes on."""
    from gateway.openai.responses import completion_logprobs

    entries = [{"token": "ab", "bytes": list(b"ab"), "logprob": -1.0},
               {"token": "<|bos|>", "bytes": list(b"<|bos|>"), "logprob": -1.0, "special": True},
               {"token": "R", "bytes": list(b"R"), "logprob": -1.0},
               {"token": "bytes:\\xe4", "bytes": [0xE4], "logprob": -1.0},
               {"token": "<|im_start|>", "bytes": list(b"<|im_start|>"), "logprob": -1.0, "special": True}]
    legacy = completion_logprobs(entries, "abR\ufffd")
    assert legacy["text_offset"] == [0, 2, 2, 3, 4]
    assert legacy["tokens"] == ["ab", "<|bos|>", "R", "bytes:\\xe4", "<|im_start|>"]


@pytest.mark.parametrize("temperature", [-1, -0.001, 2.5])
def test_a_temperature_outside_openais_range_names_that_range(temperature: float) -> None:
    with pytest.raises(OpenAIError, match=r"temperature: must be in \[0, 2\]"):
        _params(temperature=temperature)


@pytest.mark.parametrize(("body", "param"), [
    ({"user": "\udc00"}, "user"),
    ({"metadata": {"k": "\ud800"}}, "metadata.k"),
    ({"metadata": {"\udc00": "v"}}, "metadata"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"service_tier": ["priority"]}, "service_tier"),
    ({"top_p": 10**400}, "top_p"),
    ({"frequency_penalty": -(10**400)}, "frequency_penalty"),
])
def test_odd_values_are_refused_naming_the_openai_parameter(body: dict[str, object], param: str) -> None:
    """Lone surrogates (JSON's escapes allow them; no UTF-8 can carry them), lists where text is due, integers past
    float's range: a 400 about the parameter as the client named it."""
    with pytest.raises(OpenAIError) as refused:
        _params(**body)
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message


@pytest.mark.parametrize(("field", "param"), [
    ("params.max_tokens", "max_completion_tokens"), ("params.top_p", "top_p"), ("prompt_token_ids", "prompt"),
    ("prompt_token_ids[3]", "prompt[3]"), ("metadata.metadata.k", "metadata.k"), ("metadata.user", "user"),
    ("messages[0].content", "messages[0].content"),
])
def test_a_job_field_is_named_as_the_openai_parameter_it_came_from(field: str, param: str) -> None:
    renames = {"max_tokens": "max_completion_tokens"}
    assert openai_param(field, renames) == param


def test_a_message_names_a_parameter_as_the_request_spelt_it() -> None:
    renames = {"max_tokens": "max_completion_tokens"}
    message = "prompt (320 tokens) + max_tokens (4000) exceed the context (2048); lower max_tokens"
    assert renamed_in(message, renames) == ("prompt (320 tokens) + max_completion_tokens (4000) exceed the context "
                                            "(2048); lower max_completion_tokens")
    assert renamed_in("min_max_tokens stays", renames) == "min_max_tokens stays"
