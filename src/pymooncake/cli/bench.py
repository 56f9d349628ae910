"""``pymooncake bench ...``: benchmarks. Each component module under ``pymooncake.cli`` may
define ``register_bench(bench_subparsers)`` to add ``pymooncake bench <component>``."""

from __future__ import annotations

import argparse
import importlib

from pymooncake.cli.common import add_group

BENCH_MODULES: tuple[str, ...] = (
    "pymooncake.cli.trace",
    "pymooncake.cli.transfer",
    "pymooncake.cli.store",
    "pymooncake.cli.engine",
    "pymooncake.cli.sim",
    "pymooncake.cli.bench_serving",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench`` and every component's benchmark under it."""
    bench = add_group(subparsers, "bench", "benchmarks (figures go to docs/benchmarks.md)")
    for name in BENCH_MODULES:
        module = importlib.import_module(name)
        reg = getattr(module, "register_bench", None)
        if reg is not None:
            reg(bench)
