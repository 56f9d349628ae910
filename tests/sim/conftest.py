"""Factories for small in-memory traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from pymooncake.workload.trace import Trace, TraceRequest, load_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def _make_trace(rows: list[tuple[float, int, int, tuple[int, ...]]],
                block_size: int = 512) -> Trace:
    """``rows`` of (timestamp_ms, input_length, output_length, hash_ids)."""
    return Trace(tuple(TraceRequest(t, n, o, h, i) for i, (t, n, o, h) in enumerate(rows)),
                 block_size=block_size)


@pytest.fixture(scope="session")
def make_trace():  # noqa: ANN201
    """The ``_make_trace`` factory."""
    return _make_trace


@pytest.fixture(scope="session")
def conversation_head() -> Trace:
    """First 400 requests of the conversation trace (bundled copy if ../shared is absent)."""
    p = TRACES / "conversation_trace.jsonl"
    if not p.exists():
        from pymooncake.workload.trace import bundled_trace_path
        p = bundled_trace_path("conversation")
    t = load_trace(p)
    return Trace(t.requests[:400], block_size=t.block_size)
