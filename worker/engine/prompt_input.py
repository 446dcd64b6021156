"""A request's prompt, as text, token ids or chat messages, turned into checked token ids."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int, prompt: str | list[int] | None,
                     messages: list[dict[str, Any]] | None) -> list[int]:
    if (prompt is None) == (messages is None):
        raise ValueError("prompt: give exactly one of prompt or messages")
    if messages is not None:
        ids = apply_chat_template(tokenizer, messages)
    elif isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, list):
        ids = list(prompt)
        check_token_ids("prompt", ids, vocab_size)
    else:
        raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt: must not be empty")
    return ids


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
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{name}: token id {t!r} is outside the vocabulary (0..{vocab_size - 1})")
