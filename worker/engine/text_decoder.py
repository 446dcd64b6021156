"""Token ids to text: the tokenizer's own decode, or a byte table where that gives the same text.

A byte-level tokenizer (GPT-2 style: every token stands for a fixed byte
string and decoding is one lossy UTF-8 decode of the concatenated bytes)
decodes a short window far faster by table lookup and ``bytes.decode`` than
through the tokenizer's call stack. ``text_decoder_for`` picks the path once
per tokenizer: the table is used only when the tokenizer's decoder is byte
level and the table reproduces the tokenizer's own decode of every single id
and of a seeded sample of random sequences; otherwise the tokenizer decodes.
"""

from __future__ import annotations

import codecs
import random
from typing import Protocol

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

# Random sequences checked against the tokenizer before its byte table is trusted.
NUM_CHECK_SEQUENCES = 64
CHECK_SEQUENCE_LEN = 12


class TextDecoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...

    def may_end_mid_character(self, ids: list[int]) -> bool:
        """Whether a trailing U+FFFD of ``decode(ids)`` may be a character that later ids complete; False only
        when it certainly stands for bytes that no continuation makes valid."""
        ...

    def stream(self, context_ids: list[int]) -> ByteStream | None:
        """A decoder of one output's text as it grows after ``context_ids``, where this decoder can stream (None:
        decode windows instead)."""
        ...


class TokenizerDecoder:
    """The general path: whatever the tokenizer's ``decode`` does."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens

    def decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        # `decode` returns a list only for a batch of sequences; one flat list of ids gives one string.
        assert isinstance(text, str), type(text)
        return text

    def may_end_mid_character(self, ids: list[int]) -> bool:
        return True  # the tokenizer's text alone cannot tell an incomplete character from an invalid one

    def stream(self, context_ids: list[int]) -> ByteStream | None:
        return None  # a token's text may depend on the tokens around it


class ByteTableDecoder:
    """Concatenates each id's bytes and decodes them as UTF-8, invalid bytes replaced."""

    def __init__(self, table: list[bytes], fallback: TokenizerDecoder) -> None:
        self._table = table
        self._whole = [_whole_text(data) for data in table]
        """Each id's text where its bytes are whole characters (most ids), else None."""
        # Ids past the table (embedding rows with no token) are left to the tokenizer.
        self._fallback = fallback

    def decode(self, ids: list[int]) -> str:
        table = self._table
        try:
            data = b"".join([table[i] for i in ids])
        except IndexError:
            return self._fallback.decode(ids)
        return data.decode("utf-8", "replace")

    def may_end_mid_character(self, ids: list[int]) -> bool:
        """Whether the ids' bytes end in the start of a UTF-8 character still missing bytes. A byte that starts
        no character, or a start followed by a byte that cannot continue it, is U+FFFD for good."""
        table = self._table
        try:
            data = b"".join([table[i] for i in ids])
        except IndexError:
            return True
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(data[-3:], final=False)  # a character still missing bytes has at most 3 of its 4
        pending, _ = decoder.getstate()
        return bool(pending)

    def stream(self, context_ids: list[int]) -> ByteStream:
        return ByteStream(self._table, context_ids, self._whole)


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ByteStream:
    """One output's text from a byte table, its bytes decoded as UTF-8 as they come: text that is complete is
    emitted at once, bytes that may still begin a character are held, and bytes that no continuation makes valid
    are U+FFFD at once. The text is that of decoding the context and the output together, less the context's
    own decode: a character begun in the context (which decodes alone to one U+FFFD) is not the output's.

    Ids past the table contribute nothing, as the tokenizer's own decode drops ids it does not know.
    """

    def __init__(self, table: list[bytes], context_ids: list[int], whole: list[str | None] | None = None) -> None:
        """`whole`: each id's text where its bytes are whole characters, else None (`ByteTableDecoder` makes it
        once for every stream); such an id's text is that, unless bytes before it still wait for theirs."""
        self._table = table
        self._whole = whole if whole is not None else [_whole_text(data) for data in table]
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        context = self._bytes(context_ids)
        emitted = self._utf8.decode(context)
        self._num_to_drop = len(context.decode("utf-8", "replace")) - len(emitted)
        """Characters still to drop from the output's start: the U+FFFD a context ending mid-character decodes
        to alone, 0 or 1."""

    def push(self, ids: list[int], is_final: bool = False) -> str:
        """The text the ids complete; with `is_final`, held bytes too (as U+FFFD)."""
        if len(ids) == 1 and not is_final:
            return self.push_one(ids[0])
        return self._dropping(self._utf8.decode(self._bytes(ids), final=is_final))

    def push_one(self, token: int) -> str:
        """`push([token])`: a decode step's one token."""
        whole = self._whole[token] if token < len(self._whole) else ""
        if whole is not None and not self._utf8.buffer:
            text = whole  # no bytes held: the decoder would return the id's characters as they are
        else:
            text = self._utf8.decode(self._table[token] if token < len(self._table) else b"")
        return self._dropping(text) if self._num_to_drop else text

    def _dropping(self, text: str) -> str:
        """`text` less what is still to drop of the output's start."""
        if self._num_to_drop and text:
            num_dropped = min(self._num_to_drop, len(text))
            text = text[num_dropped:]
            self._num_to_drop -= num_dropped
        return text

    def _bytes(self, ids: list[int]) -> bytes:
        table, size = self._table, len(self._table)
        if len(ids) == 1:  # a decode step's one token
            return table[ids[0]] if ids[0] < size else b""
        return b"".join([table[i] if i < size else b"" for i in ids])


def text_decoder_for(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> TextDecoder:
    general = TokenizerDecoder(tokenizer, skip_special_tokens)
    table = byte_table(tokenizer, skip_special_tokens)
    if table is None:
        return general
    fast = ByteTableDecoder(table, general)
    return fast if _agrees(fast, tokenizer, skip_special_tokens) else general


def byte_table(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> list[bytes] | None:
    """Each id's bytes when the tokenizer's decoder is byte level (special tokens empty when skipped), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    char_to_byte = {char: byte for byte, char in enumerate(_byte_level_chars())}
    special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
    table: list[bytes] = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token is None or i in special:
            table.append(b"")
        elif all(c in char_to_byte for c in token):
            table.append(bytes(char_to_byte[c] for c in token))
        else:
            # The byte-level decoder passes a token with characters outside its alphabet through as UTF-8.
            table.append(token.encode())
    return table


def _agrees(fast: ByteTableDecoder, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> bool:
    size = len(tokenizer)
    rng = random.Random(0)
    samples = [[i] for i in range(size)]
    samples += [[rng.randrange(size) for _ in range(CHECK_SEQUENCE_LEN)] for _ in range(NUM_CHECK_SEQUENCES)]
    expected = tokenizer.batch_decode(
        samples, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
    return all(fast.decode(ids) == text for ids, text in zip(samples, expected))


def _byte_level_chars() -> list[str]:
    """The byte-level alphabet: entry ``b`` is the printable character standing for byte ``b``.

    Printable Latin-1 bytes stand for themselves; the rest are moved, in byte
    order, to the code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(printable)
    chars: list[str] = []
    moved = 0
    for byte in range(256):
        if byte in kept:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + moved))
            moved += 1
    return chars
