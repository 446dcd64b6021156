"""Token ids -> the token strings and bytes that OpenAI's logprobs show.

A token's bytes come from the byte-level table (GPT-2 style tokenizers), from
a ``<0xNN>`` byte-fallback piece (SentencePiece), or else from its decoded
text. Its string is those bytes as text when they are valid UTF-8 on their
own, and otherwise ``bytes:`` followed by the bytes escaped
(``bytes:\\xe2\\x80``), as OpenAI names a piece of a multi-byte character.
Special tokens (EOS) show as their own piece (``</s>``), marked ``special`` in
a logprobs entry since the output text leaves them out. The vocabulary's
table is built on the first request for logprobs, once per engine.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from worker.engine.text_decoder import byte_table

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def token_string(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenStrings:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._table: list[bytes] | None = None
        self._is_table_built = False
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._special: frozenset[int] | None = None

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """(token string, its UTF-8 bytes) of one id."""
        found = self._cache.get(token_id)
        if found is None:
            data = self._bytes(token_id)
            found = self._cache[token_id] = (token_string(data), list(data))
        return found

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special token, which the output text leaves out (its string and bytes are still
        its own piece's)."""
        if self._special is None:
            # What decoding with skip_special_tokens leaves out: the named special tokens, and every added token
            # marked special (a Llama 3 header or reserved token, which the first list need not hold).
            added = getattr(self._tokenizer, "added_tokens_decoder", None) or {}
            self._special = frozenset(self._tokenizer.all_special_ids) | frozenset(
                token_id for token_id, token in added.items() if getattr(token, "special", False))
        return token_id in self._special

    def _bytes(self, token_id: int) -> bytes:
        if not self._is_table_built:
            self._table = byte_table(self._tokenizer, skip_special_tokens=False)
            self._is_table_built = True
        if self._table is not None and token_id < len(self._table):
            return self._table[token_id]
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""  # an embedding row with no token
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if token_id in self._tokenizer.all_special_ids:
            return piece.encode()
        text = self._tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        assert isinstance(text, str), type(text)  # one flat list of ids decodes to one string
        if piece.startswith(_METASPACE) and not text.startswith(" "):
            text = " " + text  # SentencePiece drops a word's leading space when it decodes the word alone
        return text.encode()
