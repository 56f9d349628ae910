"""Batch transfer values: requests, per-request status and error codes (DESIGN.md §4).

Addresses are integers inside registered ranges, as in Mooncake's Transfer Engine: the
local side of a request is an address in this engine's registered memory, the target side
an address in the target segment's registered memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

BatchId = NewType("BatchId", int)


class TransferOp(enum.IntEnum):
    """READ copies target → local; WRITE copies local → target."""

    READ = 0
    WRITE = 1


class TransferState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class StatusCode(enum.Enum):
    """Why a request failed (``OK`` when it did not)."""

    OK = "ok"
    INVALID_ARGUMENT = "invalid_argument"
    """Range outside registered memory (either end), negative length, bad batch use."""
    NOT_FOUND = "not_found"
    """The target segment is not published in the metadata service."""
    CONNECTION_ERROR = "connection_error"
    """Every try of a slice hit a broken or refused connection."""
    TIMEOUT = "timeout"
    """Every try of a slice timed out."""
    CHECKSUM_MISMATCH = "checksum_mismatch"
    """Every try of a slice arrived corrupted."""
    INTERNAL = "internal"


class TransferError(Exception):
    """A Transfer Engine call was used wrongly (unknown batch, batch full, engine closed)."""


class SegmentNameTaken(TransferError):
    """Another live engine already publishes a segment under this name.

    Raised by ``TransferEngine.start``; like Mooncake's metadata server refusing a second
    PUT of an ``rpc_meta`` key. ``owner`` describes the publishing engine (host, pid, tcp
    port). The name frees up when that engine closes or, if it crashed, when its lease
    (``TransferConfig.segment_ttl_s``) lapses.
    """

    def __init__(self, segment: str, owner: str, metadata_url: str) -> None:
        super().__init__(
            f"segment name {segment!r} is already taken by {owner} in {metadata_url}; "
            "pick another name, or wait for that engine to close (a crashed owner's name "
            "frees up when its lease expires)")
        self.segment = segment
        self.owner = owner


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Move ``length`` bytes between ``local_addr`` (this engine) and ``target_addr`` of
    ``target_segment``. ``length == 0`` is an OK no-op."""

    op: TransferOp
    local_addr: int
    target_segment: str
    target_addr: int
    length: int

    @classmethod
    def from_buffer(cls, op: TransferOp, buffer: object, offset: int, target_segment: str,
                    target_addr: int, length: int) -> TransferRequest:
        """Convenience: the local side as (registered ``buffer``, byte ``offset``)."""
        from pymooncake.transfer.memory import buffer_address

        addr, _, _ = buffer_address(buffer)
        return cls(op, addr + offset, target_segment, target_addr, length)


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """Outcome of one request. ``reason`` is empty for OK and pending requests."""

    state: TransferState
    code: StatusCode = StatusCode.OK
    reason: str = ""
    transferred_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.state is TransferState.COMPLETED

    @classmethod
    def completed(cls, nbytes: int) -> TransferStatus:
        return cls(TransferState.COMPLETED, StatusCode.OK, "", nbytes)

    @classmethod
    def failed(cls, code: StatusCode, reason: str) -> TransferStatus:
        return cls(TransferState.FAILED, code, reason, 0)


PENDING = TransferStatus(TransferState.PENDING)


def aggregate_status(statuses: list[TransferStatus]) -> TransferStatus:
    """One status for a batch: the first failure, else pending if any, else completed.

    An empty batch is an OK no-op (BUG-37): ``COMPLETED`` with 0 bytes.
    """
    for s in statuses:
        if s.state is TransferState.FAILED:
            return s
    if any(s.state is TransferState.PENDING for s in statuses):
        return PENDING
    return TransferStatus.completed(sum(s.transferred_bytes for s in statuses))
