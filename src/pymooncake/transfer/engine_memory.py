"""The memory half of ``TransferEngine``: registering buffers (raw ranges, shared memory)
into its segment and withdrawing them; every change is published at once."""

from __future__ import annotations

from pymooncake.transfer.memory import (
    MemoryRegion,
    MemoryRegistry,
    SharedBuffer,
    buffer_address,
)
from pymooncake.transfer.transports.cma import CmaAnchor


class SegmentMemory:
    """Registration methods of ``TransferEngine`` (its ``registry``, ``_owned_shm`` and
    ``_publish`` are set up there)."""

    registry: MemoryRegistry
    _owned_shm: dict[int, SharedBuffer]
    _cma_anchor: CmaAnchor | None

    def _publish(self) -> None:
        raise NotImplementedError

    def _changed(self) -> None:
        """After a registration change: the ``cma`` anchor's table, then the descriptor."""
        if self._cma_anchor is not None:
            self._cma_anchor.publish(lambda: [(r.addr, r.length) for r in self.registry.regions])
        self._publish()

    def register_memory(self, buffer: object) -> int:
        """Register a contiguous buffer; returns its base address.

        Accepts bytearray, mmap, numpy arrays, torch CPU tensors and :class:`SharedBuffer`
        (the only kind same-host peers reach with ``shm``; others go over ``cma`` where
        both offer it, else ``tcp``). The
        buffer must stay alive until :meth:`unregister_memory`. Raises ``ValueError`` for a
        non-contiguous, empty, overlapping or CUDA buffer, ``TypeError`` for a non-buffer.
        """
        addr, nbytes, keepalive = buffer_address(buffer)
        shm_name = buffer.name if isinstance(buffer, SharedBuffer) else None
        self.registry.add(MemoryRegion(addr, nbytes, keepalive, shm_name))
        self._changed()
        return addr

    def register_memory_at(self, addr: int, length: int) -> int:
        """Register raw memory ``[addr, addr+length)`` owned by the caller (Mooncake style)."""
        if addr <= 0 or length <= 0 or addr + length > 1 << 64:
            raise ValueError(f"need addr > 0, length > 0 and addr + length <= 2**64, got "
                             f"{addr:#x} and {length}")
        self.registry.add(MemoryRegion(addr, length, None))
        self._changed()
        return addr

    def allocate_shared(self, length: int) -> SharedBuffer:
        """A new registered :class:`SharedBuffer` (freed by unregister or :meth:`close`)."""
        shm = SharedBuffer(length)
        self._owned_shm[shm.addr] = shm
        try:
            self.register_memory(shm)
        except Exception:
            self._owned_shm.pop(shm.addr).close()
            raise
        return shm

    def unregister_memory(self, addr_or_buffer: int | object) -> None:
        """Withdraw a registered range (by base address or the registered object).

        Raises ``KeyError`` when nothing is registered there. ``cma`` peers refuse the
        range in every submission made after this returns, whatever descriptor they hold
        (``transports.cma``; one made before may still land, as on every transport).
        """
        addr = (addr_or_buffer if isinstance(addr_or_buffer, int)
                else buffer_address(addr_or_buffer)[0])
        self.registry.remove(addr)
        self._changed()
        shm = self._owned_shm.pop(addr, None)
        if shm is not None:
            shm.close()
