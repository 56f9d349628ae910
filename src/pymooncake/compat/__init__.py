"""The opt-in ``mooncake`` alias: code written for Mooncake's Python wheel
(``from mooncake.store import MooncakeDistributedStore``, ``from mooncake.engine import
TransferEngine``) runs on pymooncake without edits.

Opt in per command, never by installing pymooncake::

    python -m pymooncake.compat run SCRIPT [ARGS...]     # or: run -m MODULE [ARGS...]
    export PYTHONPATH=$(python -m pymooncake.compat path)  # for a whole shell

The alias is a small ``mooncake`` package in ``shim/`` (``mooncake.store``,
``mooncake.engine``, ``mooncake.async_store``, ``mooncake.mooncake_config``,
``mooncake.http_metadata_server``, ``mooncake.buffer_pool``) whose modules re-export
pymooncake's Mooncake-compatible facades. It never shadows a real Mooncake wheel silently:
``run`` refuses when another ``mooncake`` package is importable (``--shadow`` overrides with
a warning), and importing the shim warns when another ``mooncake`` lies further down
``sys.path``. docs/compat.md lists what is covered.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"


def real_mooncake(path: list[str] | None = None) -> str | None:
    """Where a ``mooncake`` package other than the shim would be imported from (its
    directory or file), or None."""
    dirs = [p for p in (sys.path if path is None else path)
            if Path(p or ".").resolve() != SHIM_DIR]
    spec = importlib.machinery.PathFinder.find_spec("mooncake", dirs)
    if spec is None:
        return None
    locs = list(spec.submodule_search_locations or []) or [spec.origin or "?"]
    return str(locs[0])


def activate(shadow: bool = False) -> None:
    """Puts the shim first on ``sys.path`` and ``PYTHONPATH`` (so child processes, e.g.
    ``multiprocessing`` spawns, get it too). ``RuntimeError`` when a real ``mooncake`` is
    importable, unless ``shadow``."""
    other = real_mooncake()
    if other is not None and not shadow:
        raise RuntimeError(f"a real 'mooncake' package is importable from {other}; "
                           f"pymooncake's alias would shadow it (pass --shadow to run "
                           f"on pymooncake anyway)")
    if other is not None:
        print(f"pymooncake.compat: WARNING: shadowing the mooncake package at {other}",
              file=sys.stderr)
    shim = str(SHIM_DIR)
    if shim not in sys.path:
        sys.path.insert(0, shim)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([shim, *parts])
    if shadow:
        os.environ["PYMOONCAKE_SHADOW_MOONCAKE"] = "1"
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        del sys.modules[name]
