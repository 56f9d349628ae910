"""What the P2P Store publishes: manifests, holder records and their metadata keys (pure).

Nothing here does I/O. A *payload* (a model directory, a set of tensors) is a list of
*entries* (one per file or tensor); every entry is cut into *shards* of at most
``shard_bytes``; a shard is the unit that is pulled, verified (BLAKE3) and advertised.

Metadata keys (values are JSON, like the Transfer Engine's segment descriptors)::

    pymooncake/p2p/manifests/<quoted name>            -> Manifest (no lease; until unregister)
    pymooncake/p2p/holders/<quoted name>/<segment>    -> Holder (under the holder's lease)

``<quoted name>`` is ``urllib.parse.quote(name, safe="")``, so a name may contain ``/``
(``org/model``) without one name's keys being a prefix of another's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import blake3

P2P_PREFIX = "pymooncake/p2p/"
MANIFEST_PREFIX = P2P_PREFIX + "manifests/"
HOLDER_PREFIX = P2P_PREFIX + "holders/"
DEFAULT_SHARD_BYTES = 4 * 1024 * 1024
MAX_NAME_CHARS = 256


class P2PError(Exception):
    """A P2P Store operation failed (base class of every P2P error)."""


class P2PNotFound(P2PError, LookupError):
    """No payload is registered under this name (never registered, or unregistered)."""


class P2PExists(P2PError):
    """The name is already registered with different content (unregister it first)."""


class NoHolderError(P2PError):
    """Some shards have no live holder that serves verified bytes; the pull gave up.

    ``missing`` lists the shard indices that could not be obtained.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def check_name(name: object) -> str:
    """``name`` if it is a valid payload name; ``TypeError``/``ValueError`` otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"payload name must be a str, got {type(name).__name__}")
    if not name or len(name) > MAX_NAME_CHARS or any(ord(c) < 32 for c in name):
        raise ValueError(f"payload name must be 1..{MAX_NAME_CHARS} printable characters, "
                         f"got {name!r}")
    return name


def manifest_key(name: str) -> str:
    return MANIFEST_PREFIX + quote(name, safe="")


def holders_prefix(name: str) -> str:
    return HOLDER_PREFIX + quote(name, safe="") + "/"


def holder_key(name: str, segment: str) -> str:
    return holders_prefix(name) + segment


def name_from_manifest_key(key: str) -> str:
    return unquote(key[len(MANIFEST_PREFIX):])


@dataclass(frozen=True, slots=True)
class Entry:
    """One file (``path`` relative to the payload root) or tensor (``path`` = its name)."""

    path: str
    size: int
    """Bytes."""
    dtype: str | None = None
    """torch dtype name (``float16``...) for a tensor entry, ``None`` for a file."""
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Shard:
    index: int
    entry: int
    """Index into ``Manifest.entries``."""
    offset: int
    """Byte offset inside the entry."""
    size: int
    """Bytes (> 0)."""
    blake3: str
    """Hex BLAKE3-256 of the shard's bytes."""


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    kind: str
    """``files`` (a directory or files) or ``tensors``."""
    entries: tuple[Entry, ...]
    shards: tuple[Shard, ...]
    shard_bytes: int
    manifest_id: str = ""
    """BLAKE3 of the content description: same bytes ⇔ same id."""

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def encode(self) -> bytes:
        return json.dumps({
            "name": self.name, "kind": self.kind, "shard_bytes": self.shard_bytes,
            "manifest_id": self.manifest_id,
            "entries": [[e.path, e.size, e.dtype, list(e.shape) if e.shape is not None
                         else None] for e in self.entries],
            "shards": [[s.entry, s.offset, s.size, s.blake3] for s in self.shards],
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        """Raises ``ValueError`` for anything that is not a well-formed manifest."""
        try:
            d = json.loads(raw)
            entries = tuple(Entry(str(p), int(n), dt, tuple(sh) if sh is not None else None)
                            for p, n, dt, sh in d["entries"])
            shards = tuple(Shard(i, int(e), int(o), int(n), str(h))
                           for i, (e, o, n, h) in enumerate(d["shards"]))
            m = cls(str(d["name"]), str(d["kind"]), entries, shards, int(d["shard_bytes"]),
                    str(d["manifest_id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed P2P manifest: {e}") from None
        for s in m.shards:
            if not (0 <= s.entry < len(entries) and s.size > 0
                    and s.offset >= 0 and s.offset + s.size <= entries[s.entry].size):
                raise ValueError(f"malformed P2P manifest: shard {s.index} out of its entry")
        return m


def cut_shards(sizes: list[int], shard_bytes: int) -> list[tuple[int, int, int]]:
    """``(entry, offset, size)`` of every shard: each entry cut into ``shard_bytes`` pieces
    (the last one shorter); empty entries have none. ``ValueError`` if ``shard_bytes < 1``."""
    if shard_bytes < 1:
        raise ValueError(f"shard size must be >= 1 byte, got {shard_bytes}")
    return [(i, off, min(shard_bytes, n - off))
            for i, n in enumerate(sizes) for off in range(0, n, shard_bytes)]


def build_manifest(name: str, kind: str, entries: list[Entry], views: list[memoryview],
                   shard_bytes: int) -> Manifest:
    """A :class:`Manifest` whose shard checksums are computed from ``views`` (one byte view
    per entry, as long as the entry)."""
    cut = cut_shards([e.size for e in entries], shard_bytes)
    shards = tuple(Shard(k, i, off, n, blake3.blake3(views[i][off:off + n]).hexdigest())
                   for k, (i, off, n) in enumerate(cut))
    m = Manifest(check_name(name), kind, tuple(entries), shards, shard_bytes)
    desc = json.loads(m.encode())
    del desc["manifest_id"], desc["name"]
    mid = blake3.blake3(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]
    return Manifest(m.name, m.kind, m.entries, m.shards, m.shard_bytes, mid)


@dataclass(slots=True)
class Holder:
    """A peer's record for one payload: which shards it serves and where they are."""

    segment: str
    """Transfer Engine segment name of the holder."""
    manifest_id: str
    bases: list[int]
    """Address of each entry's first byte in the holder's registered memory (0 if empty)."""
    have: int = 0
    """Bitmap of the shards it holds, verified (bit ``i`` = shard ``i``)."""
    pulling: dict[str, int] = field(default_factory=dict)
    """Segment → shard pulls this peer has in flight from it (the load others see)."""
    fetching: list[int] = field(default_factory=list)
    """Shards this peer is pulling now (others avoid fetching the same rare shard)."""
    host: str = ""

    def has(self, shard: int) -> bool:
        return bool(self.have >> shard & 1)

    def count(self) -> int:
        return self.have.bit_count()

    def encode(self) -> bytes:
        return json.dumps({"segment": self.segment, "manifest_id": self.manifest_id,
                           "bases": self.bases, "have": format(self.have, "x"),
                           "pulling": self.pulling, "fetching": self.fetching,
                           "host": self.host},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Holder:
        """Raises ``ValueError`` for a malformed record."""
        try:
            d = json.loads(raw)
            return cls(str(d["segment"]), str(d["manifest_id"]), [int(b) for b in d["bases"]],
                       int(d["have"], 16), {str(k): int(v) for k, v in d["pulling"].items()},
                       [int(x) for x in d.get("fetching", [])], str(d.get("host", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed P2P holder record: {e}") from None
