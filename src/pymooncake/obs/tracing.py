"""Spans through OpenTelemetry when its API is installed; a no-op otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

try:  # opentelemetry-api is optional; without an SDK configured its spans are no-ops anyway
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - depends on the environment
    _otel_trace = None


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """``with span("store.put", key=k):`` — one OpenTelemetry span around the block."""
    if _otel_trace is None:
        yield
        return
    tracer = _otel_trace.get_tracer("pymooncake")
    with tracer.start_as_current_span(name, attributes=attributes or None):
        yield
