"""Chained prefix block keys: ``key_i = H(key_{i-1} ‖ tokens(block_i))`` (DESIGN.md §3).

``key_{-1}`` is the namespace digest, a documented fixed function of the namespace and of
nothing else (CASES BUG-04). ``H`` is BLAKE3 with a 256-bit output, a cryptographic hash
(CASES BUG-07: no fast non-cryptographic hash with a predictable seed). Token ids are
encoded canonically as little-endian unsigned 32-bit integers; one key per *full* block,
the partial last block gets none. Keys are 64-character lowercase hex strings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NewType

import blake3
import numpy as np

from pymooncake.identity.namespace import CacheNamespace

BlockKey = NewType("BlockKey", str)
BLOCK_KEY_HEX_LEN = 64
_MAX_TOKEN_ID = 2**32 - 1


def _blake3_256(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def encode_block_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian ``uint32`` array (the canonical byte encoding).

    Raises ``ValueError`` for a token id that is not an integer in ``[0, 2**32)``.
    """
    try:
        arr = np.asarray(token_ids)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"token_ids must be a flat sequence of ints in [0, 2**32): {e}") from None
    if arr.dtype == object:
        # Python ints beyond int64, or mixed types: check each element exactly.
        for t in arr.ravel().tolist():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID:
                raise ValueError(f"token ids must be ints in [0, 2**32), got {t!r}")
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers in [0, 2**32), got dtype {arr.dtype}"
                         f" (first value {arr.ravel()[0].item()!r})")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, 2**32), got range [{arr.min()}, {arr.max()}]")
    return arr.astype("<u4", copy=False)


def block_keys(token_ids: Sequence[int] | np.ndarray, namespace: CacheNamespace,
               *, hash_fn: Callable[[bytes], bytes] = _blake3_256) -> list[BlockKey]:
    """One key per full block of ``namespace.block_size`` tokens, in order.

    Args:
        token_ids: the token ids the model consumed (after tokenizer and chat template).
        namespace: the cache namespace; its digest is the root of the chain.
        hash_fn: the block hash (default BLAKE3-256). Tests inject a weak hash to force
            collisions; production code never passes it.

    Returns:
        ``len(token_ids) // block_size`` keys, each ``hash_fn`` output as lowercase hex
        (64 characters with the default hash).

    Raises:
        ValueError: a token id outside ``[0, 2**32)`` or not an integer.
        TypeError: ``namespace`` is not a ``CacheNamespace``.
    """
    if not isinstance(namespace, CacheNamespace):
        raise TypeError(f"namespace must be a CacheNamespace, got {type(namespace).__name__}")
    tokens = encode_block_tokens(token_ids)
    bs = namespace.block_size
    n_full = tokens.size // bs
    if n_full == 0:
        return []
    blocks = tokens[: n_full * bs].reshape(n_full, bs)
    prev = hash_fn(namespace.canonical_bytes()) if hash_fn is not _blake3_256 \
        else namespace.digest_bytes()
    keys: list[BlockKey] = []
    for row in blocks:
        prev = hash_fn(prev + row.tobytes())
        keys.append(BlockKey(prev.hex()))
    return keys
