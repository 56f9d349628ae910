"""pymooncake.transfer: the Transfer Engine (DESIGN.md §4, Mooncake FAST'25 §3.2.3).

Public API::

    from pymooncake.transfer import (TransferEngine, TransferConfig, TransferRequest,
                                     TransferOp, TransferStatus, TransferState, StatusCode)

``pymooncake.transfer.compat.TransferEngine`` is the Mooncake-compatible facade.
"""

from __future__ import annotations

from pymooncake.transfer.batch import (
    BatchId,
    SegmentNameTaken,
    StatusCode,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
    TransferStatus,
    aggregate_status,
)
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.engine import TransferEngine
from pymooncake.transfer.memory import SharedBuffer
from pymooncake.transfer.segment import SEGMENT_KEY_PREFIX, SegmentDescriptor, segment_key

__all__ = [
    "BatchId", "SEGMENT_KEY_PREFIX", "SegmentDescriptor", "SegmentNameTaken", "SharedBuffer",
    "StatusCode", "TransferConfig", "TransferEngine", "TransferError", "TransferOp",
    "TransferRequest",
    "TransferState", "TransferStatus", "aggregate_status", "segment_key",
]
