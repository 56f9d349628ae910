"""Independent re-derivation of the documented block-key encoding (for golden values).

Written from the documentation of ``pymooncake.identity`` (DESIGN.md §3 and the module
docstrings), not from its code: the namespace record is encoded by a hand-written msgpack
subset (no msgpack library), token ids by ``struct`` (no numpy), and hashed with the
``blake3`` package directly.

    root   = BLAKE3-256(b"pymooncake.identity.namespace/v1\\x00" + msgpack(sorted record))
    key_i  = BLAKE3-256(key_{i-1} + uint32-LE(tokens of block i))
"""

from __future__ import annotations

import struct

import blake3

NAMESPACE_TAG = b"pymooncake.identity.namespace/v1\x00"


def mp(value: object) -> bytes:
    """msgpack of None / bool-free int >= 0 / str / list / dict (str keys), spec subset."""
    if value is None:
        return b"\xc0"
    if isinstance(value, int):
        assert value >= 0
        if value < 0x80:
            return bytes([value])
        if value < 0x100:
            return b"\xcc" + struct.pack(">B", value)
        if value < 0x10000:
            return b"\xcd" + struct.pack(">H", value)
        return b"\xce" + struct.pack(">I", value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        n = len(raw)
        if n < 32:
            head = bytes([0xA0 | n])
        elif n < 0x100:
            head = b"\xd9" + struct.pack(">B", n)
        else:
            head = b"\xda" + struct.pack(">H", n)
        return head + raw
    if isinstance(value, list):
        assert len(value) < 16
        return bytes([0x90 | len(value)]) + b"".join(mp(v) for v in value)
    if isinstance(value, dict):
        assert len(value) < 16
        return bytes([0x80 | len(value)]) + b"".join(mp(k) + mp(v) for k, v in value.items())
    raise TypeError(value)


def namespace_root(*, model_id: str, weight_revision: str, tokenizer_fingerprint: str,
                   kv_dtype: str, kv_layout: str, block_size: int, tp_rank: int = 0,
                   tp_size: int = 1, adapter_id: str | None = None,
                   tenant_salt: str | None = None,
                   extra: list[list[str]] | None = None) -> bytes:
    record = {
        "adapter_id": adapter_id,
        "block_size": block_size,
        "extra": extra or [],
        "kv_dtype": kv_dtype,
        "kv_layout": kv_layout,
        "model_id": model_id,
        "tenant_salt": tenant_salt,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "weight_revision": weight_revision,
    }
    assert list(record) == sorted(record)
    return blake3.blake3(NAMESPACE_TAG + mp(record)).digest()


def reference_keys(tokens: list[int], block_size: int, root: bytes) -> list[str]:
    keys = []
    prev = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        prev = blake3.blake3(prev + struct.pack(f"<{block_size}I", *block)).digest()
        keys.append(prev.hex())
    return keys
