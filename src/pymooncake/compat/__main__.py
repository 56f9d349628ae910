"""``python -m pymooncake.compat``: run Mooncake code on pymooncake (see the package
docstring), print the shim's path, or serve a real client for Mooncake's dummy clients."""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
from pathlib import Path

from pymooncake.compat import SHIM_DIR, activate, real_mooncake


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pymooncake.compat",
                                description="Run code written for Mooncake's Python wheel "
                                            "on pymooncake.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run", help="run [--shadow] SCRIPT [ARGS...] or [--shadow] -m MODULE "
                              "[ARGS...] with 'mooncake' = pymooncake (--shadow: even when a "
                              "real mooncake package is importable, with a warning)")
    sub.add_parser("path", help="print the directory to put on PYTHONPATH")
    sub.add_parser("check", help="say whether a real mooncake package is importable")
    rc = sub.add_parser("real-client", help="serve a store client for setup_dummy clients")
    from pymooncake.compat.real_client import add_arguments

    add_arguments(rc)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        return _run(p, argv[1:])
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
    return 0


def _run(p: argparse.ArgumentParser, args: list[str]) -> int:
    """``run [--shadow] (SCRIPT | -m MODULE) [ARGS...]``: the rest goes to the target."""
    shadow = bool(args[:1] == ["--shadow"])
    args = args[1:] if shadow else args
    module = None
    if args[:1] == ["-m"]:
        if len(args) < 2:
            p.error("run -m: give a MODULE")
        module, args = args[1], args[2:]
    elif not args:
        p.error("run: give SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    try:
        activate(shadow=shadow)
    except RuntimeError as e:
        print(f"pymooncake.compat: {e}", file=sys.stderr)
        return 2
    if module is not None:
        sys.path.insert(1, "")
        if importlib.util.find_spec(module.partition(".")[0]) is None:
            print(f"pymooncake.compat run: no module named {module!r}", file=sys.stderr)
            return 1      # as `python -m MODULE`
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        if not Path(args[0]).is_file():
            print(f"pymooncake.compat run: can't open file {args[0]!r}: no such file",
                  file=sys.stderr)
            return 2      # as `python SCRIPT`
        sys.argv = list(args)
        sys.path.insert(1, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
