"""Mooncake JSONL request traces (FAST'25 release, ``FAST25-release/traces``; DESIGN.md §8).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

* ``timestamp``: arrival time in milliseconds from the trace start (int or float, >= 0);
* ``input_length``: prompt tokens (int >= 1);
* ``output_length``: generated tokens (int >= 0);
* ``hash_ids``: remapped prefix-block hashes, one per ``block_size`` (512) tokens of the
  prompt, the last one possibly covering a partial block. Equal ids mean reusable KV blocks;
  each id names a block *together with its whole prefix* (the ids are remapped chained
  hashes), so it is never longer than ``ceil(input_length / block_size)``.

Rules of the loader (documented choices):

* Unknown extra fields are ignored; blank (whitespace-only) lines are skipped and are not
  counted as invalid.
* Timestamps need not be in order. ``Trace.requests`` is in *arrival order*: a stable sort
  by ``timestamp_ms``, so requests with equal timestamps keep their file order.
  ``TraceRequest.index`` is the request's 0-based position in the file among the valid
  requests (the Mooncake traces are already sorted, so there index == position).
* Files ending in ``.gz`` (or starting with the gzip magic bytes) are read through gzip.
* Any bad line raises ``TraceError`` naming the file, the 1-based line number and what was
  wrong; with ``skip_invalid=True`` bad lines are dropped and counted in
  ``Trace.num_skipped`` (their messages kept in ``Trace.skipped_errors``).
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces."""

_GZIP_MAGIC = b"\x1f\x8b"
_REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace file or line that cannot be loaded; the message is ``FILE:LINE: what``."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        self.path = path
        self.line = line
        self.reason = message
        where = path if path is not None else "<trace>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}")


MAX_LENGTH_TOKENS = 2**31 - 1
"""Largest ``input_length``/``output_length`` accepted (tokens); far above any context."""
MAX_TIMESTAMP_MS = 1e15
"""Largest timestamp accepted (ms, ~31,000 years): keeps arithmetic on it exact enough."""


def _is_int(v: object) -> bool:
    return type(v) is int  # excludes bool (a subclass of int) and floats like 3.0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Raises ``ValueError`` on construction for a negative or non-finite timestamp, an
    ``input_length`` below 1, a negative ``output_length``, or a hash id that is not an int
    >= 0. (The ``hash_ids`` length against the block size is checked by ``load_trace``.)
    """

    timestamp_ms: float
    """Arrival time in milliseconds from the trace start."""
    input_length: int
    """Prompt length in tokens."""
    output_length: int
    """Tokens to generate."""
    hash_ids: tuple[int, ...]
    """Prefix-block hash ids, one per block of the prompt (the last may be partial)."""
    index: int = 0
    """0-based position of the request in its source file (among valid requests)."""

    def __post_init__(self) -> None:
        ts = self.timestamp_ms
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise ValueError(f"timestamp must be a finite number of ms, got {ts!r}")
        if not 0 <= ts <= MAX_TIMESTAMP_MS:
            raise ValueError(f"timestamp must be in [0, {MAX_TIMESTAMP_MS:.0e}] ms, got {ts!r}")
        if not _is_int(self.input_length) or not 1 <= self.input_length <= MAX_LENGTH_TOKENS:
            raise ValueError(f"input_length must be an int in [1, {MAX_LENGTH_TOKENS}], "
                             f"got {self.input_length!r}")
        if not _is_int(self.output_length) or not 0 <= self.output_length <= MAX_LENGTH_TOKENS:
            raise ValueError(f"output_length must be an int in [0, {MAX_LENGTH_TOKENS}], "
                             f"got {self.output_length!r}")
        if not isinstance(self.hash_ids, tuple):
            raise ValueError("hash_ids must be a tuple of ints, "
                             f"got {type(self.hash_ids).__name__}")
        for h in self.hash_ids:
            if not _is_int(h) or h < 0:
                raise ValueError(f"hash_ids must be ints >= 0, got {h!r}")
        if not _is_int(self.index) or self.index < 0:
            raise ValueError(f"index must be an int >= 0, got {self.index!r}")

    @property
    def timestamp_s(self) -> float:
        """Arrival time in seconds."""
        return self.timestamp_ms / 1000.0


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: requests in arrival order plus where they came from."""

    requests: tuple[TraceRequest, ...]
    """Requests sorted by ``timestamp_ms`` (stable: file order among equal timestamps)."""
    path: str | None = None
    """The file the trace was loaded from (``None`` for a trace built in memory)."""
    num_skipped: int = 0
    """Invalid lines dropped by ``load_trace(skip_invalid=True)``."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per hash id."""
    skipped_errors: tuple[str, ...] = ()
    """``FILE:LINE: what`` of each skipped line, in file order."""

    def __post_init__(self) -> None:
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not _is_int(self.num_skipped) or self.num_skipped < 0:
            raise ValueError(f"num_skipped must be an int >= 0, got {self.num_skipped!r}")
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)


def max_hash_ids(input_length: int, block_size: int) -> int:
    """``ceil(input_length / block_size)``: the most hash ids a prompt can have."""
    return -(-input_length // block_size)


def _parse_line(raw: bytes, block_size: int, index: int) -> TraceRequest:
    """One non-blank line → ``TraceRequest``; ``ValueError`` says what is wrong."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON ({e.msg} at column {e.pos + 1})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _REQUIRED_FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field{'s' if len(missing) > 1 else ''} "
                         + ", ".join(repr(f) for f in missing))
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"hash_ids must be a list of ints, got {type(hash_ids).__name__}")
    input_length = obj["input_length"]
    ts = obj["timestamp"]
    if _is_int(ts):
        ts = float(ts)
    req = TraceRequest(timestamp_ms=ts, input_length=input_length,
                       output_length=obj["output_length"], hash_ids=tuple(hash_ids),
                       index=index)
    limit = max_hash_ids(input_length, block_size)
    if len(hash_ids) > limit:
        raise ValueError(f"hash_ids has {len(hash_ids)} entries but input_length "
                         f"{input_length} allows at most {limit} blocks of {block_size} tokens")
    return req


def _open_binary(path: Path):  # noqa: ANN202
    with open(path, "rb") as f:
        magic = f.read(2)
    if path.suffix == ".gz" or magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")
    return open(path, "rb")


def load_trace(path: str | Path, *, skip_invalid: bool = False,
               block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """Load a Mooncake JSONL trace (``.jsonl`` or ``.jsonl.gz``).

    Args:
        path: the trace file.
        skip_invalid: drop bad lines and count them instead of raising.
        block_size: tokens per hash id (512 in the Mooncake traces).

    Returns:
        ``Trace`` with the requests in arrival order (see the module docstring).

    Raises:
        TraceError: the file cannot be read or is not UTF-8/gzip (always), or a line is
            malformed, misses a field, has a wrong type, a negative length, or more hash
            ids than ``ceil(input_length / block_size)`` (unless ``skip_invalid``). The
            message is ``FILE:LINE: what``.
        ValueError: ``block_size`` is not a positive int.
    """
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    p = Path(path)
    name = str(path)
    requests: list[TraceRequest] = []
    skipped: list[str] = []
    lineno = 0
    try:
        with _open_binary(p) as f:
            for lineno, raw in enumerate(f, start=1):  # noqa: B007 (used after the loop)
                if not raw.strip():
                    continue
                try:
                    requests.append(_parse_line(raw, block_size, len(requests)))
                except ValueError as e:
                    err = TraceError(str(e), path=name, line=lineno)
                    if not skip_invalid:
                        raise err from None
                    skipped.append(str(err))
    except TraceError:
        raise
    except FileNotFoundError:
        raise TraceError("no such file", path=name) from None
    except IsADirectoryError:
        raise TraceError("is a directory, not a trace file", path=name) from None
    except PermissionError:
        raise TraceError("permission denied", path=name) from None
    except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as e:
        raise TraceError(f"cannot read ({type(e).__name__}: {e})", path=name,
                         line=lineno + 1) from None
    if any(b.timestamp_ms < a.timestamp_ms for a, b in zip(requests, requests[1:], strict=False)):
        requests.sort(key=lambda r: r.timestamp_ms)  # stable: file order among equal times
    return Trace(requests=tuple(requests), path=name, num_skipped=len(skipped),
                 block_size=block_size, skipped_errors=tuple(skipped))


def bundled_trace_path(name: str = "conversation") -> Path:
    """Path of a trace shipped inside the package (``workload/data/<name>_trace.jsonl.gz``).

    Bundled: ``"conversation"`` (Mooncake FAST'25 conversation trace, 12,031 requests).

    Raises ``FileNotFoundError`` naming the traces that are bundled.
    """
    data = Path(__file__).resolve().parent / "data"
    p = data / f"{name}_trace.jsonl.gz"
    if not p.is_file():
        have = sorted(q.name.removesuffix("_trace.jsonl.gz") for q in data.glob("*_trace.jsonl.gz"))
        raise FileNotFoundError(f"no bundled trace {name!r}; bundled: {have}")
    return p
