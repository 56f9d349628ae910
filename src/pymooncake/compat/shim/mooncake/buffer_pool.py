"""``mooncake.buffer_pool`` on pymooncake."""

from pymooncake.store.compat._buffer_pool import BufferPool

RegisteredBufferPool = BufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
