"""Text from a growing token list, printable piece by piece, with stop strings.

Byte-level tokenizers can split one character over several tokens; until the rest arrives the
decoded text ends in U+FFFD, so nothing past the last complete character is printed. With stop
strings, the text ends just before the first one, and the tail that could still grow into one
is held back until it cannot.
"""

from __future__ import annotations

from typing import Callable, Sequence


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """(text before the earliest stop string, whether one occurred)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def _held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class IncrementalText:
    """Turns a growing token list into printable text pieces.

    ``push(token)`` returns the newly printable text; ``stopped`` turns True once a stop string
    appeared (the caller stops generating); ``flush()`` returns the rest; ``text`` is the whole
    answer, cut before the stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._printed = 0
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        text, self.stopped = cut_at_stop(text, self._stop)
        if not self.stopped:
            text = text[:len(text) - _held_back(text, self._stop)]
        return self._take(text)

    def flush(self) -> str:
        """Whatever is left (a dangling partial character prints as U+FFFD)."""
        return self._take(self.text)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        return cut_at_stop(self._decode(self._ids), self._stop)[0]

    def _take(self, text: str) -> str:
        piece = text[self._printed:]
        self._printed = max(self._printed, len(text))
        return piece
