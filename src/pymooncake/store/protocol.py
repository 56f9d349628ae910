"""Messages between store clients, storage processes and the master (private to ``store``).

Every state-changing call on an object names the exact write ``generation`` it refers to
(case BUG-18): ``put_end``/``put_revoke`` of an older generation are refused as stale.
Addresses are absolute addresses inside the target segment's registered buffer (what the
Transfer Engine takes as ``target_addr``); lengths are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pymooncake.store.config import ReplicateConfig

TIER_DRAM = "dram"
TIER_SSD = "ssd"


@dataclass(frozen=True, slots=True)
class ReplicaDesc:
    """One replica: ``length`` bytes at ``addr`` in ``segment`` (``addr=-1`` on SSD)."""

    replica_id: int
    segment: str
    addr: int
    length: int
    tier: str = TIER_DRAM
    host: str = ""
    status: str = "COMPLETE"


@dataclass(frozen=True, slots=True)
class PutHandle:
    """What ``put_start`` grants: write ``size_bytes`` to each replica, then ``put_end``."""

    key: str
    generation: int
    size_bytes: int
    replicas: tuple[ReplicaDesc, ...]


@dataclass(frozen=True, slots=True)
class ReplicaList:
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


@dataclass(frozen=True, slots=True)
class MountRequest:
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


@dataclass(frozen=True, slots=True)
class UnmountRequest:
    client_id: str
    segment: str


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    client_id: str


@dataclass(frozen=True, slots=True)
class PutStartRequest:
    client_id: str
    key: str
    size_bytes: int
    config: ReplicateConfig = field(default_factory=ReplicateConfig)


@dataclass(frozen=True, slots=True)
class PutEndRequest:
    client_id: str
    key: str
    generation: int


@dataclass(frozen=True, slots=True)
class KeyRequest:
    client_id: str
    key: str


@dataclass(frozen=True, slots=True)
class KeysRequest:
    client_id: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RemoveRequest:
    client_id: str
    key: str
    force: bool = False


@dataclass(frozen=True, slots=True)
class RemoveAllRequest:
    client_id: str
    force: bool = False


@dataclass(frozen=True, slots=True)
class BatchPutStartRequest:
    client_id: str
    keys: tuple[str, ...]
    sizes_bytes: tuple[int, ...]
    config: ReplicateConfig = field(default_factory=ReplicateConfig)


@dataclass(frozen=True, slots=True)
class BatchPutEndRequest:
    client_id: str
    keys: tuple[str, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SpillOrder:
    """Master → storage process: copy ``length`` bytes at ``addr`` of its segment to SSD."""

    key: str
    generation: int
    segment: str
    addr: int
    length: int


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Master → storage process: read ``key`` from SSD into ``addr`` of its segment."""

    key: str
    generation: int
    segment: str
    addr: int
    length: int


@dataclass(frozen=True, slots=True)
class SsdRecoverRequest:
    """Storage process → master after a restart: objects found intact on its SSD tier,
    ``(key, size_bytes, per-chunk checksum)`` each, to become SSD replicas in
    ``segment``; ``final`` on the last batch (the master then forgets what it kept for
    this holder and was not claimed)."""

    client_id: str
    segment: str
    holder: str
    entries: tuple[tuple[str, int, bytes], ...]
    final: bool = True


@dataclass(frozen=True, slots=True)
class BadReplicaRequest:
    """Client → master: replicas of ``key`` (write ``generation``) whose bytes failed the
    checksum on a read, confirmed by a second read."""

    client_id: str
    key: str
    generation: int
    replica_ids: tuple[int, ...]


# -- compact wire forms of the hot-path answers (lists, no per-field maps) ----------------

def replica_to_wire(r: object) -> list:
    """``[replica_id, segment, addr, length, tier, host, status]`` of a replica-like object."""
    return [r.replica_id, r.segment, r.addr, r.length, r.tier, r.host,  # type: ignore[attr-defined]
            getattr(r, "status", None) or ("COMPLETE" if getattr(r, "complete", True)
                                           else "PROCESSING")]


def replica_from_wire(w: list) -> ReplicaDesc:
    return ReplicaDesc(int(w[0]), str(w[1]), int(w[2]), int(w[3]), str(w[4]), str(w[5]),
                       str(w[6]))


def put_handle_from_wire(d: dict) -> PutHandle:
    return PutHandle(d["key"], d["generation"], d["size_bytes"],
                     tuple(replica_from_wire(r) for r in d["replicas"]))


def replica_list_from_wire(d: dict) -> ReplicaList:
    return ReplicaList(d["key"], d["size_bytes"], d["generation"],
                       tuple(replica_from_wire(r) for r in d["replicas"]), d["lease_ttl_ms"],
                       d.get("checksum"))
