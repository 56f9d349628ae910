"""pymooncake's ``mooncake`` alias (see ``pymooncake.compat``): Mooncake's Python package
names, backed by pymooncake. Warns when a real ``mooncake`` package lies further down
``sys.path``, which this one hides."""

from __future__ import annotations

import os as _os
import sys as _sys
import warnings as _warnings

__pymooncake_shim__ = True


def _check_shadow() -> None:
    from pymooncake.compat import real_mooncake

    other = real_mooncake()
    if other is not None and _os.environ.get("PYMOONCAKE_SHADOW_MOONCAKE") != "1":
        _warnings.warn(f"'mooncake' is pymooncake's alias here; it hides the real Mooncake "
                       f"package at {other}. Remove {__path__[0]!r} from PYTHONPATH to use "
                       f"Mooncake itself.", stacklevel=3)
        print(f"pymooncake: WARNING: the mooncake alias hides {other}", file=_sys.stderr)


_check_shadow()
