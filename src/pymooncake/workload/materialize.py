"""Token materialisation: trace hash ids → prompt token ids a real engine can serve.

The Mooncake traces carry no text, only ``hash_ids`` of 512-token prefix blocks. To replay
them on the real engine each id becomes a fixed block of token ids:

* block ``i`` of a request (tokens ``[i*b, (i+1)*b)``, ``b = block_size // scale``) holds the
  first ``b`` tokens of the stream of ``hash_ids[i]``; a partial last block holds the first
  tokens of that stream, as many as the prompt has left;
* the stream of an id is BLAKE3 in extendable-output mode over the canonical bytes
  ``b"pymooncake.workload.block/v1:" + f"{seed}:{hash_id}"``, read as little-endian
  ``uint32`` words ``w`` and mapped to ``reserved_low + w % (vocab_size - reserved_low)``;
  never Python ``hash()``, so every process and run gives the same tokens;
* prompt tokens after the hashed blocks (only when a trace gives fewer ids than
  ``ceil(input_length / block_size)``) come from the stream of the request itself,
  ``b"pymooncake.workload.tail/v1:" + f"{seed}:{index}"``.

So equal hash ids give equal blocks and different ids give different blocks (two blocks of
``b`` tokens agree by chance with probability ``(vocab_size - reserved_low) ** -b``).

Scaling: ``scale`` divides lengths so a CPU engine can serve a trace. The prompt has
``ceil(input_length / scale)`` tokens and blocks of ``block_size // scale`` tokens, so block
boundaries stay aligned (block ``i`` of the scaled prompt stands for block ``i`` of the
original); ``block_size % scale == 0`` is required. Output lengths become
``ceil(output_length / scale)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np

from pymooncake.workload.trace import DEFAULT_BLOCK_SIZE, Trace, TraceRequest

_BLOCK_TAG = b"pymooncake.workload.block/v1:"
_TAIL_TAG = b"pymooncake.workload.tail/v1:"


def _stream(tag: bytes, seed: int, ident: int, n: int, vocab_size: int,
            reserved_low: int) -> np.ndarray:
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    raw = blake3.blake3(tag + f"{seed}:{ident}".encode()).digest(length=4 * n)
    words = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    return reserved_low + words % (vocab_size - reserved_low)


def _check_int(name: str, v: object, lo: int) -> None:
    if type(v) is not int or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def scaled_length(length: int, scale: int) -> int:
    """``ceil(length / scale)``: a prompt or output length after scaling down by ``scale``."""
    return -(-length // scale)


def _validate(vocab_size: int, block_size: int, scale: int, seed: int,
              reserved_low: int) -> None:
    _check_int("block_size", block_size, 1)
    _check_int("scale", scale, 1)
    _check_int("seed", seed, 0)
    _check_int("reserved_low", reserved_low, 0)
    _check_int("vocab_size", vocab_size, reserved_low + 2)
    if block_size % scale:
        raise ValueError(f"block_size ({block_size}) must be a multiple of scale ({scale}) so "
                         "block boundaries stay aligned; pick a scale that divides it")


def materialize_tokens(req: TraceRequest, *, vocab_size: int,
                       block_size: int = DEFAULT_BLOCK_SIZE, scale: int = 1, seed: int = 0,
                       reserved_low: int = 0) -> list[int]:
    """Prompt token ids for one trace request (see the module docstring for the rule).

    Args:
        req: the trace request.
        vocab_size: token ids are ``< vocab_size``.
        block_size: tokens per hash id in the trace (512 for the Mooncake traces).
        scale: divide lengths by this; ``block_size`` must be a multiple of it.
        seed: another seed gives another, equally consistent, set of blocks.
        reserved_low: token ids are ``>= reserved_low`` (keep BOS/EOS/special ids, usually the
            lowest ones, out of the prompt; for reserved ids at the top pass a smaller
            ``vocab_size``).

    Returns:
        ``ceil(req.input_length / scale)`` token ids.

    Raises:
        ValueError: a non-int or out-of-range argument, ``vocab_size < reserved_low + 2``,
            or ``block_size % scale != 0``.
    """
    _validate(vocab_size, block_size, scale, seed, reserved_low)
    return _materialize(req, vocab_size, block_size // scale, scale, seed, reserved_low).tolist()


def _materialize(req: TraceRequest, vocab_size: int, b: int, scale: int, seed: int,
                 reserved_low: int) -> np.ndarray:
    n = scaled_length(req.input_length, scale)
    out = np.empty(n, dtype=np.int64)
    pos = 0
    for h in req.hash_ids:
        if pos >= n:
            break
        take = min(b, n - pos)
        out[pos:pos + take] = _stream(_BLOCK_TAG, seed, h, take, vocab_size, reserved_low)
        pos += take
    if pos < n:
        out[pos:] = _stream(_TAIL_TAG, seed, req.index, n - pos, vocab_size, reserved_low)
    return out


@dataclass(frozen=True, slots=True)
class MaterializedRequest:
    """A trace request turned into something an engine can serve."""

    index: int
    """``TraceRequest.index`` of the source request."""
    timestamp_ms: float
    """Arrival time (ms), as in the trace (apply ``scale_arrivals`` for the rate)."""
    token_ids: tuple[int, ...]
    """Prompt token ids, ``ceil(input_length / scale)`` of them."""
    max_tokens: int
    """Tokens to generate: ``ceil(output_length / scale)``."""
    hash_ids: tuple[int, ...]
    """The source request's hash ids (block ``i`` of ``token_ids`` stands for ``hash_ids[i]``)."""
    block_size: int
    """Tokens per block of ``token_ids`` (``trace.block_size // scale``)."""


def materialize_trace(trace: Trace, *, vocab_size: int, scale: int = 1, seed: int = 0,
                      reserved_low: int = 0) -> list[MaterializedRequest]:
    """``materialize_tokens`` for every request of ``trace`` (arrival order, its block size).

    Raises ``ValueError`` as ``materialize_tokens``.
    """
    _validate(vocab_size, trace.block_size, scale, seed, reserved_low)
    b = trace.block_size // scale
    return [MaterializedRequest(
        index=r.index, timestamp_ms=r.timestamp_ms,
        token_ids=tuple(_materialize(r, vocab_size, b, scale, seed, reserved_low).tolist()),
        max_tokens=scaled_length(r.output_length, scale), hash_ids=r.hash_ids, block_size=b)
        for r in trace.requests]
