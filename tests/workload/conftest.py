"""Fixtures of the workload tests: the bundled and shared Mooncake traces, a JSONL writer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pymooncake.workload import Trace, bundled_trace_path, load_trace

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def shared_trace(name: str) -> Path:
    p = SHARED_TRACES / f"{name}_trace.jsonl"
    if not p.is_file():
        pytest.skip(f"{p} not present (the public Mooncake traces live next to a checkout)")
    return p


@pytest.fixture(scope="session")
def conversation() -> Trace:
    """The conversation trace bundled in the package (always present)."""
    return load_trace(bundled_trace_path("conversation"))


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Write lines (dicts are JSON-encoded, strings written as-is) to a fresh .jsonl file."""
    counter = iter(range(1_000_000))

    def write(lines: list[object], name: str | None = None) -> Path:
        p = tmp_path / (name or f"trace{next(counter)}.jsonl")
        text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
        p.write_text(text)
        return p

    return write


def req(ts: float, inp: int, out: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}
