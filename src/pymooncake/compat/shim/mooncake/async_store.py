"""``mooncake.async_store`` on pymooncake."""

from pymooncake.store.compat import MooncakeDistributedStoreAsync

__all__ = ["MooncakeDistributedStoreAsync"]
