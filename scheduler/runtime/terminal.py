"""Text for a terminal: what a command prints of a completion."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped, so a terminal shows them as such."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)
