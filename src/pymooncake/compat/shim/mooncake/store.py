"""``mooncake.store`` on pymooncake: ``pymooncake.store.compat``'s classes and enums."""

from pymooncake.store.compat import *  # noqa: F403
from pymooncake.store.compat import __all__ as _all
from pymooncake.store.compat._buffer_pool import BufferPool

__all__ = [*_all, "BufferPool"]
