"""``pymooncake`` command-line entry point.

Every sub-command lives in its own module under ``pymooncake.cli`` and exposes
``register(subparsers)``; the modules are listed in ``COMMAND_MODULES`` and imported
lazily enough that a command never pays for another component's imports (torch is only
imported by the engine's commands when they run).

Conventions for every sub-command:

* ``--help`` on each;
* ``--json`` on each that reports figures: one JSON document on stdout;
* bad arguments → exit status 2 and a single ``pymooncake: error: ...`` line on stderr;
* a runtime failure the user can fix (missing file, malformed trace line) → exit status 1
  and a single ``pymooncake: error: ...`` line, no traceback;
* a command whose optional dependencies are not installed (torch for the engine, fastapi
  for the API, ...) → exit status 1 and one line naming the extra to install
  (``MODULE_EXTRAS``), caught here for every command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Sub-command modules, each with ``register(subparsers) -> None``.
COMMAND_MODULES: tuple[str, ...] = (
    "pymooncake.cli.trace",
    "pymooncake.cli.transfer",
    "pymooncake.cli.store",
    "pymooncake.cli.engine",
    "pymooncake.cli.sim",
    "pymooncake.cli.replay",
    "pymooncake.cli.serve",
    "pymooncake.cli.conductor",
    "pymooncake.cli.worker",
    "pymooncake.cli.profile",
    "pymooncake.cli.model",
    "pymooncake.cli.bench",
    "pymooncake.cli.p2p",
    "pymooncake.cli.ep",
    "pymooncake.cli.cpp",
)

MODULE_EXTRAS: dict[str, str] = {
    "torch": "engine", "safetensors": "engine", "tokenizers": "engine", "gguf": "engine",
    "jinja2": "engine", "fastapi": "api", "uvicorn": "api", "starlette": "api",
}
"""Top-level modules of the optional dependencies → the ``pymooncake[...]`` extra that
installs them (pyproject.toml)."""


class UsageError(Exception):
    """Bad arguments detected after parsing (exit status 2)."""


class CommandError(Exception):
    """A failure the user can fix, reported as one line (exit status 1)."""


def missing_extra_message(module: str) -> str | None:
    """The one line for a missing optional dependency, or None if ``module`` is not one."""
    extra = MODULE_EXTRAS.get(module.split(".")[0])
    if extra is None:
        return None
    return (f"this command needs {module.split('.')[0]} (the '{extra}' extra), which is not "
            f"installed: pip install 'pymooncake[{extra}]' (or 'pymooncake[all]' for "
            "everything)")


def require_extras(*modules: str) -> None:
    """Raise ``ModuleNotFoundError`` (reported by ``main`` as one line naming the extra) for
    the first of ``modules`` that cannot be imported — checked before a command starts
    children or loads a model, so the user sees the reason, not a child's exit status."""
    import importlib.util
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ModuleNotFoundError(f"No module named {m!r}", name=m)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error message and exit status 2 on bad arguments."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from pymooncake import __version__

    parser = OneLineArgumentParser(
        prog="pymooncake",
        description="Mooncake-style KVCache-centric disaggregated LLM serving in Python.",
    )
    parser.add_argument("--version", action="version", version=f"pymooncake {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=OneLineArgumentParser)
    # Not ``required``: argparse would then report a missing COMMAND before an unknown
    # flag; ``main`` reports a missing command itself, in one line.
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pymooncake.cli.cluster import die_with_parent
    die_with_parent()       # a LocalCluster child: SIGTERM when the cluster's process dies
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:  # no command, or a command group without its sub-command
        group = getattr(args, "parser_for_help", parser)
        choices = next((a.choices for a in group._actions
                        if isinstance(a, argparse._SubParsersAction)), {})
        sys.stderr.write(f"{group.prog}: error: missing command (choose from "
                         f"{', '.join(choices)}; see --help)\n")
        return 2
    try:
        return int(handler(args) or 0)
    except BrokenPipeError:  # e.g. `pymooncake trace head | head -1`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except UsageError as e:
        sys.stderr.write(f"pymooncake: error: {e}\n")
        return 2
    except CommandError as e:
        sys.stderr.write(f"pymooncake: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        line = missing_extra_message(e.name or "")
        if line is None:
            raise
        sys.stderr.write(f"pymooncake: error: {line}\n")
        return 1
    except ValueError as e:   # a --model that names nothing installed (e.g. smollm2)
        from pymooncake.engine.model.registry import ModelNotFoundError
        if not isinstance(e, ModelNotFoundError):
            raise
        sys.stderr.write(f"pymooncake: error: {e}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
