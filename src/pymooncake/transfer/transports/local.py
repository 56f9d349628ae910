"""``local`` and ``shm`` transports: one memcpy between two mapped ranges.

``local`` copies between ranges of the same engine; ``shm`` between this process's
registered range and a same-host peer's shared-memory range mapped here
(:class:`~pymooncake.transfer.memory.PeerMapping`). ``ctypes.memmove`` releases the GIL.
"""

from __future__ import annotations

import ctypes

from pymooncake.transfer.batch import TransferOp


def copy(op: TransferOp, local_addr: int, target_addr: int, length: int) -> None:
    """WRITE: local → target; READ: target → local. Both ranges were checked by the caller."""
    if length <= 0:
        return
    if op is TransferOp.WRITE:
        ctypes.memmove(target_addr, local_addr, length)
    else:
        ctypes.memmove(local_addr, target_addr, length)
