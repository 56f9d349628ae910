"""Incremental detokenization with OpenAI stop strings, in time linear in the output.

Each ``feed`` decodes only a small window of the newest tokens, as vLLM does for any
tokenizer with a ``decode``: ``prefix`` marks where the last certain text began, ``read``
where it ended. The text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is the
new text, emitted once it does not end in an incomplete UTF-8 sequence (decoded as U+FFFD);
then both marks move up. Decoding from ``prefix`` rather than ``read`` gives the decoder the
context a tokenizer may need (a SentencePiece leading space, a multi-byte character split
across tokens), so the deltas concatenate to the full decode.

Stop strings: the new certain text joins ``pending``, the part not handed out yet. The
earliest stop string in ``pending`` ends the output there (the stop string itself is not
output, OpenAI semantics); otherwise everything but the longest suffix that could still
grow into a stop string is handed out. Since that suffix is always held back, a stop string
can only start inside ``pending``, so the search never looks at text already handed out.

Cost per token: two decodes of a window of a few tokens plus a scan of ``pending``, which
holds at most the longest stop string plus one delta. A window only grows while its text
keeps ending in U+FFFD (a run of invalid bytes the model chose to emit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_INCOMPLETE = "\ufffd"


class _Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids, get the new text; ``feed`` reports whether a stop string matched.

    ``codec`` is anything with ``decode(ids) -> str`` (the byte-level tokenizer, a GGUF or
    HF tokenizer). ``decode_calls``/``decoded_tokens`` count the work done (tests check it
    grows linearly with the output).
    """

    def __init__(self, codec: _Decoder, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = tuple(s for s in stop if s)
        self._hold_max = max((len(s) - 1 for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.stopped = False
        self._prefix = 0  # ids[prefix:read] decode to the text last made certain
        self._read = 0
        self._pending = ""  # certain text not handed out yet (a possible stop-string start)
        self.decode_calls = 0
        self.decoded_tokens = 0

    def _decode(self, start: int, end: int) -> str:
        self.decode_calls += 1
        self.decoded_tokens += end - start
        return self.codec.decode(self.token_ids[start:end])

    def _advance(self) -> str:
        """New certain text of the tokens fed so far ("" while it ends mid-character)."""
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self._prefix, self._read) if self._read > self._prefix else ""
        text = self._decode(self._prefix, len(self.token_ids))
        if len(text) <= len(before) or text.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        return text[len(before):]

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for k in range(min(self._hold_max, len(text)), 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _cut(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` begins, or None."""
        found = [i for i in (text.find(s) for s in self.stop) if i != -1]
        return min(found) if found else None

    def feed(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; return (new text, stop string matched)."""
        if self.stopped:
            return "", True
        self.token_ids.extend(token_ids)
        pending = self._pending + self._advance()
        if not self.stop:
            self._pending = ""
            return pending, False
        cut = self._cut(pending)
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return pending[:cut], True
        end = len(pending) - self._holdback(pending)
        self._pending = pending[end:]
        return pending[:end], False

    def flush(self) -> str:
        """The held-back tail, at the end of generation (an incomplete character at the very
        end comes out as U+FFFD, as the full decode has it)."""
        if self.stopped:
            return ""
        rest = ""
        if self._read < len(self.token_ids):
            before = self._decode(self._prefix, self._read) if self._read > self._prefix else ""
            rest = self._decode(self._prefix, len(self.token_ids))[len(before):]
            self._prefix = self._read = len(self.token_ids)
        out = self._pending + rest
        self._pending = ""
        cut = self._cut(out)
        if cut is not None:
            self.stopped = True
            return out[:cut]
        return out
