"""Text to and from a terminal: the prompt a command is given, and what it prints of a completion."""

from __future__ import annotations

from typing import BinaryIO

STDIN_ARG = "-"
"""The prompt argument that means: read the prompt from standard input."""


def printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped, so a terminal shows them as such."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


def prompt_argument(value: str, stdin: BinaryIO) -> str:
    """The prompt a command line gives: ``value``, or all of ``stdin`` when it is ``-`` (a file, a pipe).

    Raises ``ValueError`` for text that is not UTF-8: bytes the terminal's encoding could not decode stay in
    ``argv`` as lone surrogates, which no job can carry; and for an empty prompt, which no job takes either.
    """
    if value == STDIN_ARG:
        try:
            text = stdin.read().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the prompt read from standard input is not valid UTF-8 text") from None
        if not text:
            raise ValueError("prompt: standard input held no text (a job's prompt must be a non-empty string)")
        return text
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the prompt is not valid UTF-8 text") from None
    if not value:
        raise ValueError("prompt: must be a non-empty string (- reads it from standard input)")
    return value
