"""``pymooncake`` sub-commands of the transfer component (filled in by its issue)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this component's sub-commands to the ``pymooncake`` parser."""
