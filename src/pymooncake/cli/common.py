"""Helpers shared by the ``pymooncake`` sub-command modules."""

from __future__ import annotations

import argparse
import json
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
