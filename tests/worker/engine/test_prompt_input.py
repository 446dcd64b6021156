"""Prompts tokenized by the engine: a text longer than the tokenizer's own `model_max_length` draws no warning
from transformers, since the engine judges length against its context and says so itself."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from worker.engine.prompt_input import prompt_token_ids

WARNING = "Token indices sequence length is longer than the specified maximum"


@contextmanager
def transformers_log() -> Iterator[list[str]]:
    """The messages transformers logs meanwhile (its loggers stop at the library's root logger)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)


def test_a_prompt_past_the_tokenizers_maximum_is_tokenized_without_transformers_warning(
        tiny_model: Callable[..., str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model(), model_max_length=32)
    with transformers_log() as messages:
        ids = prompt_token_ids(tokenizer, len(tokenizer), "word " * 40, None)
        chat = prompt_token_ids(tokenizer, len(tokenizer), None, [{"role": "user", "content": "word " * 40}])
    assert len(ids) > 32 and len(chat) > 32
    assert not [m for m in messages if WARNING in m]
    with transformers_log() as messages:
        tokenizer("word " * 40)  # transformers' own call warns, so the check above could see the warning
    assert [m for m in messages if WARNING in m]
