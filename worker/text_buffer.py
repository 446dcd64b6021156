"""Text that only grows: a request's output, added to a piece at a time, streamed from where it was last shown."""

from __future__ import annotations


class TextBuffer:
    """Text that only grows, held as the pieces added since it was last joined: adding a piece costs the piece,
    not the text so far (a string attribute grown by `+=` is copied whole each time, which over a long output
    is quadratic). The whole text is joined only when asked for."""

    def __init__(self) -> None:
        self._joined = ""
        self._pieces: list[str] = []
        self.length = 0
        """Characters of the whole text."""

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)

    @property
    def text(self) -> str:
        """The whole text (joined here, once per call that finds new pieces)."""
        if self._pieces:
            self._joined += "".join(self._pieces)
            self._pieces.clear()
        return self._joined


class StreamedText(TextBuffer):
    """A `TextBuffer` streamed out in parts: `recent` is the text after the parts taken so far, the end a stop
    string is looked for in and the next part to stream; it stays short when parts are taken as the text grows."""

    def __init__(self) -> None:
        super().__init__()
        self.recent = ""

    def append(self, piece: str) -> None:
        if piece:
            super().append(piece)
            self.recent += piece

    def take(self, num_chars: int) -> str:
        """The first `num_chars` characters of `recent`, which then starts after them."""
        taken, self.recent = self.recent[:num_chars], self.recent[num_chars:]
        return taken
