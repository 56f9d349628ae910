"""Messages between store clients, storage processes and the master (private to ``store``).

Every message is an ``rpc.Message`` (a ``msgspec.Struct``): decoded straight from the
frame with each field's type checked, an unknown or missing field refused naming it; the
master's handlers take them as they come (no hand validation) and answer them (replicas
travel as maps of named fields, not positional lists).

Every state-changing call on an object names the exact write ``generation`` it refers to
(case BUG-18): ``put_end``/``put_revoke`` of an older generation are refused as stale.
Addresses are absolute addresses inside the target segment's registered buffer (what the
Transfer Engine takes as ``target_addr``); lengths are bytes.
"""

from __future__ import annotations

from typing import Any

from pymooncake.rpc import Message

TIER_DRAM = "dram"
TIER_SSD = "ssd"


class ReplicaDesc(Message):
    """One replica: ``length`` bytes at ``addr`` in ``segment`` (``addr=-1`` on SSD)."""

    replica_id: int
    segment: str
    addr: int
    length: int
    tier: str = TIER_DRAM
    host: str = ""
    status: str = "COMPLETE"


class PutHandle(Message):
    """What ``put_start`` grants: write ``size_bytes`` to each replica, then ``put_end``."""

    key: str
    generation: int
    size_bytes: int
    replicas: tuple[ReplicaDesc, ...]


class ReplicaList(Message):
    """Readable replicas of a published object, local-first order is the client's job.

    ``lease_ttl_ms``: the read lease granted with this answer; a read that completes after
    it has lapsed must report ``LEASE_EXPIRED`` (case BUG-15).
    """

    key: str
    size_bytes: int
    generation: int
    replicas: tuple[ReplicaDesc, ...]
    lease_ttl_ms: float
    checksum: bytes | None = None
    """The object's per-chunk digests (``store.checksum``); ``None``: stored without one
    (its bytes then never verify, so never read)."""
    promote: bool = False
    """The object lives only on SSD (no replica here): ask ``load_replica_list``, which
    loads it back into DRAM first."""


class MountRequest(Message):
    client_id: str
    segment: str
    host: str
    base_addr: int
    size_bytes: int
    ssd_capacity_bytes: int = 0
    rpc_host: str = ""
    rpc_port: int = 0
    holder: str = ""
    """The storage process's SSD directory identity (``SsdTier.holder()``): a mount with
    the holder of a still-mounted segment replaces it (the holder restarted)."""


class UnmountRequest(Message):
    client_id: str
    segment: str


class HeartbeatRequest(Message):
    client_id: str


class PutStartRequest(Message):
    client_id: str
    key: str
    size_bytes: int
    config: dict[str, Any] | None = None
    """A ``ReplicateConfig``'s fields (``None``: the defaults); checked by the master."""


class PutEndRequest(Message):
    client_id: str
    key: str
    generation: int
    checksum: bytes | None = None
    """The written bytes' ``store.checksum.digests`` (``put_end``; none for a revoke)."""


class KeyRequest(Message):
    client_id: str
    key: str


class ExistRequest(Message):
    client_id: str
    key: str
    exclude_segments: tuple[str, ...] = ()
    """Segments the caller knows have failed: a key only there is reported absent."""


class KeysRequest(Message):
    client_id: str
    keys: tuple[str, ...]


class BatchExistRequest(Message):
    client_id: str
    keys: tuple[str, ...]
    exclude_segments: tuple[str, ...] = ()


class RemoveRequest(Message):
    client_id: str
    key: str
    force: bool = False


class RemoveAllRequest(Message):
    client_id: str
    force: bool = False


class BatchPutStartRequest(Message):
    client_id: str
    keys: tuple[str, ...]
    sizes_bytes: tuple[int, ...]
    config: dict[str, Any] | None = None
    """A ``ReplicateConfig``'s fields (``None``: the defaults); checked by the master."""

    def __post_init__(self) -> None:
        _same_length(self.keys, "sizes_bytes", self.sizes_bytes)


class BatchPutEndRequest(Message):
    client_id: str
    keys: tuple[str, ...]
    generations: tuple[int, ...]
    checksums: tuple[bytes | None, ...] | None = None

    def __post_init__(self) -> None:
        _same_length(self.keys, "generations", self.generations)
        if self.checksums is not None:
            _same_length(self.keys, "checksums", self.checksums)


def _same_length(keys: tuple, name: str, other: tuple) -> None:
    if len(other) != len(keys):
        raise ValueError(f"{name} has {len(other)} items for {len(keys)} keys")


class SpillOrder(Message):
    """Master → storage process: copy ``length`` bytes at ``addr`` of its segment to SSD."""

    key: str
    generation: int
    segment: str
    addr: int
    length: int


class LoadOrder(Message):
    """Master → storage process: read ``key`` from SSD into ``addr`` of its segment."""

    key: str
    generation: int
    segment: str
    addr: int
    length: int


class SsdRecoverRequest(Message):
    """Storage process → master after a restart: objects found intact on its SSD tier,
    ``(key, size_bytes, per-chunk checksum)`` each, to become SSD replicas in
    ``segment``; ``final`` on the last batch (the master then forgets what it kept for
    this holder and was not claimed)."""

    client_id: str
    segment: str
    holder: str
    entries: tuple[tuple[str, int, bytes], ...]
    final: bool = True


class BadReplicaRequest(Message):
    """Client → master: replicas of ``key`` (write ``generation``) whose bytes failed the
    checksum on a read, confirmed by a second read."""

    client_id: str
    key: str
    generation: int
    replica_ids: tuple[int, ...]




class ReadAnswer(Message):
    """One key's answer in ``batch_get_replica_list`` / ``load_replica_list``: the replica
    list, or the error ``[code, message]``."""

    r: ReplicaList | None = None
    e: tuple[int, str] | None = None


class WriteAnswer(Message):
    """One key's answer in ``batch_put_start``: the handle, or the error."""

    r: PutHandle | None = None
    e: tuple[int, str] | None = None
