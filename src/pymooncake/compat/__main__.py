"""``python -m pymooncake.compat``: run Mooncake code on pymooncake (see the package
docstring), print the shim's path, or serve a real client for Mooncake's dummy clients."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from pymooncake.compat import SHIM_DIR, activate, real_mooncake


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pymooncake.compat",
                                description="Run code written for Mooncake's Python wheel "
                                            "on pymooncake.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run SCRIPT (or -m MODULE) with 'mooncake' = pymooncake")
    r.add_argument("--shadow", action="store_true",
                   help="run even when a real mooncake package is importable (warns)")
    r.add_argument("-m", dest="module", default=None, help="run a module, as python -m")
    r.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]")
    sub.add_parser("path", help="print the directory to put on PYTHONPATH")
    sub.add_parser("check", help="say whether a real mooncake package is importable")
    rc = sub.add_parser("real-client", help="serve a store client for setup_dummy clients")
    from pymooncake.compat.real_client import add_arguments

    add_arguments(rc)
    a = p.parse_args(argv)
    if a.cmd == "path":
        print(SHIM_DIR)
        return 0
    if a.cmd == "check":
        other = real_mooncake()
        print(f"real mooncake at {other}" if other else "no real mooncake package importable")
        return 0
    if a.cmd == "real-client":
        from pymooncake.compat.real_client import serve

        return serve(a)
    if not a.module and not a.target:
        p.error("run: give SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    try:
        activate(shadow=a.shadow)
    except RuntimeError as e:
        print(f"pymooncake.compat: {e}", file=sys.stderr)
        return 2
    if a.module:
        sys.argv = [a.module, *a.target]
        runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    else:
        script = a.target[0]
        sys.argv = list(a.target)
        sys.path.insert(1, str(Path(script).resolve().parent))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
