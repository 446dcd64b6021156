"""Incremental detokenization and stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from worker.engine.default_model import build_tokenizer
from worker.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from worker.text_buffer import StreamedText


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_pieces_concatenate_to_the_full_decode(tokenizer) -> None:
    rng = random.Random(0)
    text = "Grüße 👋🏽 from 東京 — ok"
    output = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer("prompt: ").input_ids)
    pieces: list[str] = []
    start = 0
    while start < len(output):
        size = rng.randint(1, 3)
        pieces.append(detok.push(output[start : start + size]))
        start += size
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_character_is_emitted_only_when_complete(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    emoji = list("😀".encode())  # 4 byte tokens; ids equal byte values
    assert [detok.push([b]) for b in emoji] == ["", "", "", "😀"]
    assert detok.push([ord("!")]) == "!"
    assert detok.text == "😀!"


def test_bytes_that_no_continuation_makes_valid_are_emitted_at_once(tokenizer) -> None:
    # A random-weight byte-level model emits such bytes often; holding each until some later token ends in a
    # whole character would delay every following character for nothing.
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    assert detok.push([0x80]) == "\ufffd"  # a continuation byte with nothing to continue
    assert detok.push([0xFF]) == "\ufffd"  # never part of UTF-8
    assert detok.push([0xE6]) == ""  # may start a character: held
    assert detok.push([ord("a")]) == "\ufffda"  # it did not: the start is lost, the "a" is not
    assert detok.push([0xE6, 0xBC]) == ""
    assert detok.push([0xA2]) == "漢"
    assert detok.text == "\ufffd\ufffd\ufffda漢"


def test_random_bytes_stream_to_exactly_their_decode(tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.randrange(256) for _ in range(rng.randint(0, 8))]
        output = [rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0), rng.randrange(0xC2, 0xF5)])
                  for _ in range(rng.randint(1, 12))]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pieces = [detok.push([b]) for b in output] + [detok.flush()]
        context = prompt[-6:]
        whole = bytes(context + output).decode("utf-8", "replace")[len(bytes(context).decode("utf-8", "replace")):]
        assert "".join(pieces) == detok.text == whole, (prompt, output)


def test_special_tokens_are_skipped_or_kept(tokenizer) -> None:
    ids = [*b"hi", tokenizer.eos_token_id]
    skipping = IncrementalDetokenizer(tokenizer, [])
    assert skipping.push(ids) == "hi"
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert keeping.push(ids) == "hi<|eos|>"


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer) -> None:
    # The context window may start inside a character of the prompt.
    prompt = tokenizer("漢字漢字").input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.push(list("é".encode())) == "é"


def test_text_before_a_partial_character_is_not_held_back(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    first, second, third = "漢".encode()
    assert detok.push([ord("a"), first]) == "a"
    assert detok.push([second]) == ""
    assert detok.push([third, ord("b")]) == "漢b"
    assert detok.text == "a漢b"


def test_flush_releases_an_incomplete_tail(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push([ord("a"), 0xE6]) == "a"
    assert detok.flush() == "\ufffd"
    assert detok.text == "a\ufffd"


def test_works_with_a_loaded_checkpoint_tokenizer(tiny_model) -> None:
    loaded = AutoTokenizer.from_pretrained(tiny_model("llama"), local_files_only=True)
    output = loaded("naïve 🚀", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(loaded, loaded("hello").input_ids)
    assert "".join(detok.push([t]) for t in output) == "naïve 🚀"


def test_find_stop_returns_the_earliest_stop_ending_in_new_text() -> None:
    assert find_stop("hello world", ["wor", "o w"], new_text_len=5) == (4, "o w")
    assert find_stop("hello world", ["xyz"], new_text_len=5) is None
    # "lo" lies wholly in the old text: it was checked before, not reported now.
    assert find_stop("hello world", ["lo"], new_text_len=5) is None
    # A stop straddling old and new text is found.
    assert find_stop("abcSTOP", ["STOP"], new_text_len=2) == (3, "STOP")
    # Same start: the longer stop wins, so more of it is trimmed.
    assert find_stop("say END!", ["END", "END!"], new_text_len=4) == (4, "END!")


def test_partial_stop_len_holds_back_a_possible_stop_start() -> None:
    assert partial_stop_len("the answer is <", ["</s>", "STOP"]) == 1
    assert partial_stop_len("done </", ["</s>"]) == 2
    assert partial_stop_len("done", ["</s>"]) == 0
    # A complete stop is find_stop's job; only proper prefixes are held back.
    assert partial_stop_len("x</s>", ["</s>"]) == 0
    assert partial_stop_len("aaST", ["STOP", "aST"]) == 2


def test_streaming_with_hold_back_never_emits_a_stop(tokenizer) -> None:
    stops = ["<END>"]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = ""
    stopped_at = None
    for byte in b"alpha <EN beta <END> gamma":
        new = detok.push([byte])
        text = detok.text
        hit = find_stop(text, stops, len(new))
        if hit is not None:
            stopped_at = hit[0]
            streamed += text[len(streamed) : hit[0]]
            break
        safe_end = len(text) - partial_stop_len(text, stops)
        streamed += text[len(streamed) : safe_end]
    assert stopped_at == len("alpha <EN beta ")
    assert streamed == "alpha <EN beta "


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("add"), st.text(max_size=6)),
                          st.tuples(st.just("take"), st.integers(min_value=0, max_value=20)),
                          st.tuples(st.just("text"), st.none())), max_size=60))
def test_the_text_buffer_reads_as_the_string_it_grew_into(ops: list[tuple[str, object]]) -> None:
    """Pieces added, the recent part taken and the whole text joined in any order: always what one string grown
    piece by piece would give, `recent` always the text after what was taken."""
    buffer, model, taken = StreamedText(), "", 0
    for op, arg in ops:
        if op == "add":
            assert isinstance(arg, str)
            buffer.append(arg)
            model += arg
        elif op == "take":
            assert isinstance(arg, int)
            assert buffer.take(arg) == model[taken:taken + arg]
            taken = min(len(model), taken + arg)
        else:
            assert buffer.text == model
        assert buffer.length == len(model) and buffer.recent == model[taken:]


def test_a_stop_string_is_found_past_long_text_reading_only_its_end(tokenizer) -> None:
    """A stop found near the end of a long output cuts the whole text where it starts, as a search of the
    whole text would."""
    from scheduler import SamplingParams
    from scheduler.sequence import Sequence
    from worker.engine.request_state import RequestState
    from worker.engine.sampler import SampledToken

    filler = "lorem ipsum dolor " * 200
    output = tokenizer(filler + "THE END and more", add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=len(output) + 5, stop=["THE END", "xyz"], ignore_eos=True)
    seq = Sequence("r", [1, 2, 3], params)
    state = RequestState(seq, IncrementalDetokenizer(tokenizer, [1, 2, 3]), eos_token_ids=set())
    shown = ""
    decision = None
    for token in output:
        seq.output_token_ids.append(token)
        decision = state.on_token(SampledToken(token, None, None))
        out = state.take_output()
        shown += out.new_text
        assert out.text == shown, "the text so far, read back from the state"
        if decision is not None:
            break
    assert decision is not None and decision.stop_reason == "THE END"
    assert state.text == shown == filler
