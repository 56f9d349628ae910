"""``pymooncake ep bench``: recovery time and degraded throughput of elastic EP.

Filled in below (run_bench)."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    raise NotImplementedError


def summary(res: dict[str, Any]) -> str:
    return str(res)
