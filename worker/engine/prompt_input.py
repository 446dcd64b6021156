"""A request's prompt, as text, token ids or chat messages, turned into checked token ids."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


# How many times the longest token's characters a text prompt may hold per token of context before it is refused
# untokenized. A token covers at most that many characters of the text it came from, so a longer prompt cannot fit;
# the margin is for normalizers that drop characters (control characters, combining accents) before splitting.
_CHARS_MARGIN = 4


class PromptTooLong(ValueError):
    """A text prompt (or chat content) refused by its length in characters, before it was tokenized."""


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """The most characters of text a prompt may have to be tokenized at all: beyond it the prompt cannot fit in
    `max_model_len` tokens, and tokenizing megabytes of it would hold the engine up for seconds to minutes."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return _CHARS_MARGIN * max_model_len * max(longest, 1)


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, prompt: str | list[int] | None,
                     messages: list[dict[str, Any]] | None, max_chars: int | None = None) -> list[int]:
    """Checked token ids of the prompt. `max_chars` (`max_prompt_chars`): a longer text is refused untokenized.

    Text is tokenized without transformers' warning about sequences past the tokenizer's ``model_max_length``
    ("will result in indexing errors"): the engine checks every prompt against its own context, and refuses
    one too long with an error of its own."""
    if (prompt is None) == (messages is None):
        raise ValueError("prompt: give exactly one of prompt or messages")
    if max_chars is not None:
        _check_length(prompt, messages, max_chars)
    if messages is not None:
        ids = apply_chat_template(tokenizer, messages)
        _check_tokenized("messages", ids, vocab_size)
    elif isinstance(prompt, str):
        ids = list(tokenizer(prompt, verbose=False)["input_ids"])
        _check_tokenized("prompt", ids, vocab_size)
    elif isinstance(prompt, list):
        ids = list(prompt)
        check_token_ids("prompt", ids, vocab_size)
    else:
        raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt: must not be empty")
    return ids


def _check_length(prompt: str | list[int] | None, messages: list[dict[str, Any]] | None, max_chars: int) -> None:
    if isinstance(prompt, str) and len(prompt) > max_chars:
        raise PromptTooLong(f"prompt: {len(prompt)} characters cannot fit the model's context (at most "
                            f"{max_chars} characters are tokenized)")
    if isinstance(messages, list):
        total = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
        if total > max_chars:
            raise PromptTooLong(f"messages: {total} characters of content cannot fit the model's context "
                                f"(at most {max_chars} characters are tokenized)")


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} maps")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}]: must be a map with string role and content")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # template errors come in many types (jinja, KeyError, ...)
        raise ValueError(f"messages: the chat template failed: {e}") from e
    # The template writes the special tokens itself.
    return list(tokenizer(rendered, add_special_tokens=False, verbose=False)["input_ids"])


def _check_tokenized(name: str, ids: list[int], vocab_size: int) -> None:
    """A tokenizer with more tokens than the model has embeddings (tokens added to it without resizing the
    model's) makes ids the model cannot look up: refused as the request's fault, before the engine meets them."""
    top = max(ids, default=0)
    if top >= vocab_size:
        raise ValueError(f"{name}: the tokenizer made token id {top} of it, past the model's vocabulary "
                         f"(0..{vocab_size - 1}): the checkpoint's tokenizer has tokens its model has no embedding "
                         "for (added without resizing the model's embeddings?)")


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{name}: token id {t!r} is outside the vocabulary (0..{vocab_size - 1})")
