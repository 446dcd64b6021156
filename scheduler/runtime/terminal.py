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
    ``argv`` as lone surrogates, which no job can carry.
    """
    if value == STDIN_ARG:
        try:
            return stdin.read().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the prompt read from standard input is not valid UTF-8 text") from None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the prompt is not valid UTF-8 text") from None
    return value
