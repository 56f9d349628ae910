"""``mooncake.store`` on pymooncake: ``pymooncake.store.compat``'s classes and enums."""

from pymooncake.store.compat import *  # noqa: F403
