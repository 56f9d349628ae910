"""Incremental detokenization with OpenAI stop strings.

Text is emitted as soon as it is certain: a trailing incomplete UTF-8 sequence (decoded
as U+FFFD) is held back, and so is any suffix that could still grow into a stop string.
When a stop string appears, the text before it is the output and the stop string is not
(OpenAI semantics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids, get the new text; ``feed`` reports whether a stop string matched."""

    def __init__(self, codec: _Decoder, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out
        self.stopped = False

    def _text(self) -> str:
        return self.codec.decode(self.token_ids)

    def _holdback(self, text: str) -> int:
        """Length of the suffix of ``text`` that must not be emitted yet."""
        hold = 0
        if text.endswith("\ufffd"):
            hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def feed(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; return (new text, stop string matched)."""
        if self.stopped:
            return "", True
        self.token_ids.extend(token_ids)
        text = self._text()
        cut = None
        for s in self.stop:
            i = text.find(s, max(0, self.emitted - len(s) + 1))
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
            out = text[self.emitted:cut]
            self.emitted = max(self.emitted, cut)
            return out, True
        end = len(text) - self._holdback(text)
        out = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, False

    def flush(self) -> str:
        """The held-back tail, at the end of generation."""
        if self.stopped:
            return ""
        text = self._text()
        out = text[self.emitted:]
        self.emitted = len(text)
        return out
