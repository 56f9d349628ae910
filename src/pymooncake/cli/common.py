"""Helpers shared by the ``pymooncake`` sub-command modules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def add_group(subparsers: argparse._SubParsersAction, name: str,
              help: str) -> argparse._SubParsersAction:
    """Add a command group (``pymooncake NAME SUB ...``) and return its sub-parsers.

    ``pymooncake NAME`` alone prints the group's help and exits with status 2.
    """
    group = subparsers.add_parser(name, help=help, description=help)
    group.set_defaults(handler=None, parser_for_help=group)
    sub = group.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND",
                               parser_class=type(group))
    return sub


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json``: print one JSON document on stdout instead of the human summary."""
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def emit(payload: Any, as_json: bool, human: Callable[[Any], str] | None = None) -> None:
    """Print ``payload`` as JSON (``--json``) or through ``human`` as text."""
    if as_json or human is None:
        json.dump(payload, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(human(payload).rstrip("\n") + "\n")


def port_arg(text: str) -> int:
    """argparse ``type=`` for a TCP port flag: an integer in 0..65535 (0 = any free port).

    A bad value is a parse error (exit 2, one line naming the flag and the value) instead
    of an ``OverflowError`` from ``bind()`` after the process started."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = any free port), "
                                         f"got {port}")
    return port


def unusable_dir(path: str) -> str | None:
    """Why ``path`` cannot serve as a writable directory (made if absent), else ``None``."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create the directory: {e.strerror or type(e).__name__}"
    if not os.access(path, os.W_OK | os.X_OK):
        return "the directory is not writable"
    return None
