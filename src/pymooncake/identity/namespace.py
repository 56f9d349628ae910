"""The cache namespace: everything that changes a KV block's values or bytes (DESIGN.md §3).

The namespace digest is the root of every block-key chain. It is a BLAKE3-256 hash of a
*canonical, tagged* byte encoding of the namespace fields (msgpack of a map whose keys are
the field names, sorted), so

* no two different namespaces encode to the same bytes: every field is tagged by its name
  and length-prefixed by msgpack, so an adapter called ``"S"`` and a tenant salt ``"S"``
  differ (CASES BUG-01), and ``None`` (absent) differs from ``""``;
* nothing depends on process state: no ``hash()``, no random seed, no ``PYTHONHASHSEED``
  (CASES BUG-04/BUG-05); the digest of a namespace is the same in every process and run.

Optional "extra" identity (``extra``) has one canonical empty value: ``None``, ``()``,
``[]`` and ``{}`` all normalise to the empty tuple and so are one identity (CASES BUG-05).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import blake3
import msgpack

# Bytes per element of each KV dtype name the project knows (CASES BUG-06: the dtype is part
# of the identity; its width is part of the layout descriptor).
KV_DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

_WHAT = {
    "model_id": "give the model name",
    "weight_revision": "give the commit hash or a content digest of the weight files",
    "tokenizer_fingerprint": "give identity.tokenizer_fingerprint(...) of the tokenizer",
    "kv_dtype": f"give one of {sorted(KV_DTYPE_BYTES)}",
    "kv_layout": "give identity.kv_layout_descriptor(...)",
}
_ELEM_BYTES = re.compile(r"(?:^|;)elem_bytes=(\d+)(?:;|$)")


def _as_int(name: str, v: Any) -> int:
    """An integral value (int or numpy integer, never bool) as a plain int."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {v!r}")
    return int(v)


MAX_BLOCK_SIZE = 2**20
"""Largest ``block_size`` (tokens) and ``tp_size`` accepted; keeps the encoding in range."""

# Version tag of the encoding; changing the encoding must change this tag.
_NAMESPACE_TAG = b"pymooncake.identity.namespace/v1\x00"


def kv_layout_descriptor(num_layers: int, num_kv_heads_per_shard: int, head_dim: int,
                         kv_dtype: str, layout: str = "paged_lkhd") -> str:
    """Canonical KV layout descriptor string for ``CacheNamespace.kv_layout``.

    It commits to the layer count, KV heads per tensor-parallel shard, head dimension,
    element width in bytes and the memory layout name (CASES BUG-06), e.g.
    ``"paged_lkhd;layers=4;kv_heads=2;head_dim=64;elem_bytes=4"``.

    Raises ``ValueError`` for non-positive sizes or an unknown dtype.
    """
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; known: {sorted(KV_DTYPE_BYTES)}")
    for name, v in (("num_layers", num_layers), ("num_kv_heads_per_shard", num_kv_heads_per_shard),
                    ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(layout, str) or not layout or ";" in layout or "=" in layout:
        raise ValueError(f"layout must be a non-empty name without ';' or '=', got {layout!r}")
    num_layers, num_kv_heads_per_shard, head_dim = (
        int(num_layers), int(num_kv_heads_per_shard), int(head_dim))
    return (f"{layout};layers={num_layers};kv_heads={num_kv_heads_per_shard};"
            f"head_dim={head_dim};elem_bytes={KV_DTYPE_BYTES[kv_dtype]}")


def _normalise_extra(extra: Any) -> tuple[tuple[str, str], ...]:
    if extra is None:
        return ()
    items = extra.items() if isinstance(extra, Mapping) else extra
    out = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError(f"extra must be a mapping or (key, value) pairs, got item {item!r}")
        k, v = item
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"extra keys and values must be str, got {k!r}: {v!r}")
        out.append((k, v))
    keys = [k for k, _ in out]
    if len(set(keys)) != len(keys):
        raise ValueError(f"extra has duplicate keys: {keys}")
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Identity of a KV cache: two blocks are the same only under equal namespaces.

    All string fields are compared exactly (no case folding). ``digest()`` is stable across
    processes, runs and machines.

    Raises ``ValueError`` on construction for a non-str or empty ``model_id``,
    ``weight_revision``, ``tokenizer_fingerprint``, ``kv_dtype`` or ``kv_layout``; an
    unknown ``kv_dtype``; a ``kv_layout`` whose ``elem_bytes=`` disagrees with ``kv_dtype``;
    a non-int (bools included) or non-positive ``block_size`` or ``tp_size``; ``tp_rank``
    outside ``[0, tp_size)``; a non-str ``adapter_id``/``tenant_salt``; a malformed
    ``extra``. Numpy integers are accepted and stored as ``int``.
    """

    model_id: str
    """Model name, e.g. ``"meta-llama/Llama-3.1-8B-Instruct"``."""
    weight_revision: str
    """Exact weight revision: a commit hash or a content digest of the weight files."""
    tokenizer_fingerprint: str
    """``identity.tokenizer_fingerprint`` of the tokenizer files + chat template."""
    kv_dtype: str
    """KV cache element type, one of ``KV_DTYPE_BYTES``."""
    kv_layout: str
    """KV layout descriptor, see ``kv_layout_descriptor``."""
    block_size: int
    """Tokens per KV block."""
    tp_rank: int = 0
    """Tensor-parallel rank whose KV shard this is."""
    tp_size: int = 1
    """Tensor-parallel world size."""
    adapter_id: str | None = None
    """Content fingerprint of the LoRA/adapter (``identity.adapter_fingerprint``), never its
    bare name (CASES BUG-02); ``None`` for the base model."""
    tenant_salt: str | None = None
    """Per-tenant salt when caches must not be shared across tenants; ``None`` = shared."""
    extra: tuple[tuple[str, str], ...] = ()
    """Further identity as sorted (key, value) pairs; ``None``/``()``/``{}`` are all empty."""

    def __post_init__(self) -> None:
        for name in ("model_id", "weight_revision", "tokenizer_fingerprint", "kv_dtype",
                     "kv_layout"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise ValueError(f"CacheNamespace.{name} must be str, got {type(v).__name__}")
            if not v.strip():
                raise ValueError(f"CacheNamespace.{name} must not be empty or blank: "
                                 f"{_WHAT[name]}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"CacheNamespace.kv_dtype {self.kv_dtype!r} unknown; "
                             f"use one of {sorted(KV_DTYPE_BYTES)}")
        for name in ("block_size", "tp_size", "tp_rank"):
            object.__setattr__(self, name, _as_int(f"CacheNamespace.{name}", getattr(self, name)))
        for name in ("block_size", "tp_size"):
            v = getattr(self, name)
            if not 0 < v <= MAX_BLOCK_SIZE:
                raise ValueError(f"CacheNamespace.{name} must be an int in [1, {MAX_BLOCK_SIZE}],"
                                 f" got {v!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"CacheNamespace.tp_rank must be in [0, {self.tp_size}), "
                             f"got {self.tp_rank!r}")
        for name in ("adapter_id", "tenant_salt"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"CacheNamespace.{name} must be str or None, got {v!r}")
        m = _ELEM_BYTES.search(self.kv_layout)
        if m is not None and int(m.group(1)) != KV_DTYPE_BYTES[self.kv_dtype]:
            raise ValueError(f"CacheNamespace.kv_layout says elem_bytes={m.group(1)} but kv_dtype "
                             f"{self.kv_dtype!r} has {KV_DTYPE_BYTES[self.kv_dtype]} bytes per "
                             "element; build kv_layout with kv_layout_descriptor(..., kv_dtype)")
        object.__setattr__(self, "extra", _normalise_extra(self.extra))

    def canonical_bytes(self) -> bytes:
        """The tagged canonical encoding the digest is taken over (msgpack, sorted keys)."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["extra"] = [list(p) for p in self.extra]
        return _NAMESPACE_TAG + msgpack.packb(dict(sorted(record.items())), use_bin_type=True)

    def digest_bytes(self) -> bytes:
        """BLAKE3-256 of ``canonical_bytes()``: 32 bytes, the root of every key chain."""
        return blake3.blake3(self.canonical_bytes()).digest()

    def digest(self) -> str:
        """``digest_bytes()`` as 64 lowercase hex characters."""
        return self.digest_bytes().hex()
