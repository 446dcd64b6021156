"""A params map from the wire: null is the default but for max_tokens, and errors name JSON's types."""

from __future__ import annotations

import pytest

from scheduler.params import InvalidParam, SamplingParams


def test_null_is_the_default_but_for_max_tokens() -> None:
    names = ["min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
             "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "include_stop_str_in_output",
             "speculative"]
    assert SamplingParams.from_dict({name: None for name in names}) == SamplingParams()
    assert SamplingParams.from_dict({"max_tokens": None}).max_tokens is None  # to the end of the context
    assert SamplingParams.from_dict({}).max_tokens == SamplingParams().max_tokens == 16


@pytest.mark.parametrize(("params", "message"), [
    ({"stop": 5}, "stop: must be a string or a list of strings, got integer"),
    ({"stop_token_ids": "7"}, "stop_token_ids: must be a list of integers, got string"),
    ({"stop_token_ids": [1, 2.5]}, "stop_token_ids: must be a list of non-negative integers, got number"),
    ({"top_k": [1]}, "top_k: must be an integer, got array"),
    ({"temperature": {"a": 1}}, "temperature: must be a number, got object"),
    ({"top_p": True}, "top_p: must be a number, got boolean"),
])
def test_a_wrong_type_is_named_as_json_names_it(params: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidParam) as raised:
        SamplingParams.from_dict(params)
    assert str(raised.value) == message


def test_top_k_takes_minus_one_or_zero_for_none_and_says_so_of_other_negatives() -> None:
    assert SamplingParams(top_k=-1).top_k == SamplingParams(top_k=0).top_k == 0
    with pytest.raises(InvalidParam, match=r"^top_k: must be 0 or -1 \(no top-k\) or a positive count, got -5$"):
        SamplingParams(top_k=-5)


def test_stop_strings_are_bounded_in_number_and_length() -> None:
    """Every token of the batch is checked against every job's stops: a job may not bring thousands."""
    from scheduler.params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop) == MAX_STOP_STRINGS
    with pytest.raises(InvalidParam, match=f"at most {MAX_STOP_STRINGS} stop strings, got 250000"):
        SamplingParams.from_dict({"stop": [f"ab{i}" for i in range(250_000)]})
    with pytest.raises(InvalidParam, match=f"each stop string at most {MAX_STOP_LENGTH} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_LENGTH + 1)])
