"""``mooncake.engine`` on pymooncake: ``pymooncake.transfer.compat.TransferEngine``."""

from pymooncake.transfer.compat import TransferEngine, TransferOpcode

__all__ = ["TransferEngine", "TransferOpcode"]
