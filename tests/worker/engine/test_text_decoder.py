"""The byte-table decoder against the tokenizer's own decode: same text, piece by piece."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from worker.engine.default_model import build_tokenizer
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.text_decoder import ByteTableDecoder, TokenizerDecoder, text_decoder_for


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _random_ids(rng: random.Random, size: int, n: int) -> list[int]:
    """Mostly bytes that form or break UTF-8 (lead and continuation bytes), some ASCII and specials."""
    pool = [*range(0x80, 0x100), *range(0x20, 0x7F), *range(256, size)]
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_table_is_chosen_for_the_byte_level_tokenizer_and_decodes_the_same(
    tokenizer, skip_special_tokens: bool
) -> None:
    fast = text_decoder_for(tokenizer, skip_special_tokens)
    assert isinstance(fast, ByteTableDecoder)
    general = TokenizerDecoder(tokenizer, skip_special_tokens)
    rng = random.Random(1)
    for _ in range(500):
        ids = _random_ids(rng, len(tokenizer), rng.randint(0, 16))
        assert fast.decode(ids) == general.decode(ids), ids


def test_ids_past_the_vocabulary_fall_back_to_the_tokenizer(tokenizer) -> None:
    fast = text_decoder_for(tokenizer)
    ids = [ord("a"), len(tokenizer) + 5, ord("b")]
    assert fast.decode(ids) == TokenizerDecoder(tokenizer, True).decode(ids)


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_equals_the_general_path_and_is_never_behind_it(tokenizer, seed: int) -> None:
    """The byte table knows which trailing U+FFFD no later byte completes and emits it at once, where the
    general path must hold every trailing U+FFFD: its text is always a prefix of the table's, and in the end
    the same."""
    rng = random.Random(seed)
    size = len(tokenizer)
    prompt = _random_ids(rng, size, rng.randint(0, 10))
    fast = IncrementalDetokenizer(tokenizer, prompt, decoder=text_decoder_for(tokenizer))
    general = IncrementalDetokenizer(tokenizer, prompt, decoder=TokenizerDecoder(tokenizer, True))
    pushed, num_ahead = 0, 0
    while pushed < 300:
        chunk = _random_ids(rng, size, rng.randint(1, 3))
        pushed += len(chunk)
        fast.push(chunk)
        general.push(chunk)
        assert fast.text.startswith(general.text)
        num_ahead += len(fast.text) > len(general.text)
    fast.flush()
    general.flush()
    assert fast.text == general.text
    assert "\ufffd" in fast.text  # the draw did split and break characters
    assert num_ahead > 0  # and the table path emitted some of them earlier


def test_a_loaded_checkpoint_tokenizer_gets_the_byte_table(tiny_model) -> None:
    loaded = AutoTokenizer.from_pretrained(tiny_model("llama"), local_files_only=True)
    decoder = text_decoder_for(loaded)
    assert isinstance(decoder, ByteTableDecoder)
    text = "naïve 🚀 東京"
    assert decoder.decode(loaded(text, add_special_tokens=False).input_ids) == text


def test_a_tokenizer_whose_table_disagrees_keeps_the_general_path(tokenizer) -> None:
    # A decode that rewrites the text after the byte-level decoder cannot be reproduced from bytes alone.
    class Cleaning(type(tokenizer)):  # type: ignore[misc]
        def decode(self, ids, **kwargs):  # type: ignore[no-untyped-def]
            return super().decode(ids, **kwargs).upper()

        def batch_decode(self, sequences, **kwargs):  # type: ignore[no-untyped-def]
            return [self.decode(ids, **kwargs) for ids in sequences]

    odd = build_tokenizer()
    odd.__class__ = Cleaning
    decoder = text_decoder_for(odd)
    assert isinstance(decoder, TokenizerDecoder)
    assert decoder.decode([*b"a, b"]) == "A, B"


class _WindowsOnly(ByteTableDecoder):
    """The byte table decoding windows, as a detokenizer does for decoders that cannot stream."""

    def stream(self, context_ids: list[int]) -> None:  # type: ignore[override]
        return None


@pytest.mark.parametrize("seed", range(8))
def test_the_byte_stream_gives_the_windows_text_and_is_never_behind_it(tokenizer, seed: int) -> None:
    """Streaming a byte table's output through one UTF-8 decoder gives the text decoding windows of the same
    table gives, never later (windows hold every trailing U+FFFD while a character may be unfinished after
    them): prompts that end inside a character, ids past the vocabulary, specials, flushes."""
    fast = text_decoder_for(tokenizer)
    assert isinstance(fast, ByteTableDecoder)
    windows = _WindowsOnly(fast._table, TokenizerDecoder(tokenizer, True))
    rng = random.Random(seed)
    size = len(tokenizer)
    for _ in range(40):
        prompt = _random_ids(rng, size, rng.randint(0, 10))
        streamed = IncrementalDetokenizer(tokenizer, prompt, decoder=fast)
        windowed = IncrementalDetokenizer(tokenizer, prompt, decoder=windows)
        assert streamed._stream is not None and windowed._stream is None
        for _ in range(rng.randint(1, 30)):
            chunk = _random_ids(rng, size, rng.randint(1, 3))
            if rng.random() < 0.05:
                chunk.insert(rng.randrange(len(chunk) + 1), size + rng.randrange(5))  # an embedding row past it
            streamed.push(chunk)
            windowed.push(chunk)
            assert streamed.text.startswith(windowed.text), (prompt, chunk)
        streamed.flush()
        windowed.flush()
        assert streamed.text == windowed.text, prompt
