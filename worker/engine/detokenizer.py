"""Streaming token ids to text, and finding stop strings in it.

Decoding token by token is wrong for two reasons: a character may span
several byte tokens (it decodes to U+FFFD until complete), and some
tokenizers render a token differently depending on what precedes it (leading
spaces). So the detokenizer decodes a short window that starts a few tokens
before the new ones and emits only the text that the new tokens add, and
only once it no longer ends in an incomplete character. Where the tokenizer's
bytes are known (``ByteTableDecoder``), no window is needed: the output's
bytes stream through one incremental UTF-8 decoder (``ByteStream``), and a
U+FFFD that no later byte can complete (a lone continuation byte, say) is
emitted at once rather than held until some later token ends in a whole
character.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from worker.engine.text_decoder import TextDecoder, text_decoder_for
from worker.text_buffer import StreamedText

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens.
NUM_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        decoder: TextDecoder | None = None,
    ) -> None:
        """``decoder``: the tokenizer's decoder chosen once (``text_decoder_for``) and shared by requests."""
        self._decoder = decoder if decoder is not None else text_decoder_for(tokenizer, skip_special_tokens)
        self._ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        # _ids[prefix_offset:read_offset] is context already emitted; _ids[read_offset:] is pending.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Characters of the pending tokens' text already emitted while a partial character waits.
        self._num_emitted_pending = 0
        self.buffer = StreamedText()
        """The output text emitted so far, read at its end each step (`text` joins it whole)."""
        # A byte table's text streams: one incremental UTF-8 decode per push, no windows decoded twice.
        self._stream = self._decoder.stream(self._ids)

    @property
    def text(self) -> str:
        """All output text emitted so far (joined on each call that finds new text: read `buffer` each step)."""
        return self.buffer.text

    def push(self, token_ids: list[int]) -> str:
        """Add output tokens; return the text that became stable (possibly empty)."""
        if self._stream is not None:
            new_text = self._stream.push(token_ids)
            self.buffer.append(new_text)
            return new_text
        self._ids.extend(token_ids)
        return self._advance(is_final=False)

    def push_one(self, token_id: int) -> str:
        """`push([token_id])`, without the list where the output streams (a decode step's one token)."""
        if self._stream is not None:
            new_text = self._stream.push_one(token_id)
            self.buffer.append(new_text)
            return new_text
        return self.push([token_id])

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete character at the end of output)."""
        if self._stream is not None:
            return self._add(self._stream.push([], is_final=True))
        return self._advance(is_final=True)

    def _add(self, new_text: str) -> str:
        self.buffer.append(new_text)
        return new_text

    def _advance(self, is_final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self._decoder.decode
        prefix_len = len(decode(self._ids[self._prefix_offset : self._read_offset]))
        full_text = decode(self._ids[self._prefix_offset :])
        is_complete = (is_final or not full_text.endswith(REPLACEMENT_CHAR)
                       or not self._decoder.may_end_mid_character(self._ids[self._prefix_offset:]))
        # Text before a trailing partial character is stable already.
        stable_end = len(full_text) if is_complete else len(full_text.rstrip(REPLACEMENT_CHAR))
        start = prefix_len + self._num_emitted_pending
        new_text = full_text[start:stable_end]
        if is_complete:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._num_emitted_pending = 0
        else:
            self._num_emitted_pending += len(new_text)
        self.buffer.append(new_text)
        return new_text


def find_stop(text: str, stops: list[str], new_text_len: int) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last `new_text_len` characters of `text`.

    Returns `(index where the stop starts, the stop)`: `text[:index]` is the
    output to keep. Stops wholly inside the older text were already checked
    when that text was new, so only the tail is searched.
    """
    best: tuple[int, str] | None = None
    old_len = len(text) - new_text_len
    for stop in stops:
        index = text.find(stop, max(0, old_len - len(stop) + 1))
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
            best = (index, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    That much text is held back from streaming: the next tokens may complete the stop.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
