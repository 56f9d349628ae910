"""Spans through OpenTelemetry: off by default, console or OTLP export when configured.

Serving issue item 7 (per-stage spans). ``configure_tracing`` installs a tracer provider
that this module owns (never the process-global one, which OpenTelemetry lets a process
set only once), so tests and several configurations in one process do not clash. While
tracing is off, ``span`` falls back to the global OpenTelemetry tracer (a no-op unless the
embedding application configured one) and ``record_span`` returns at once.

Exporters (``--otel`` / env ``PYMOONCAKE_OTEL``):

- ``console``: ``opentelemetry-sdk``'s ``ConsoleSpanExporter`` writing JSON spans to
  **stderr** (stdout carries the workers' JSON "ready" lines), batched.
- ``otlp``: OTLP over HTTP/protobuf (``opentelemetry-exporter-otlp-proto-http``) to
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the standard variable; default http://localhost:4318),
  batched.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

try:  # opentelemetry-api is a core dependency; guard anyway so obs imports everywhere
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - depends on the environment
    _otel_trace = None

EXPORTERS = ("console", "otlp")
"""Allowed names of ``configure_tracing``'s ``exporter`` (and of the CLI's ``--otel``)."""

ENV_VAR = "PYMOONCAKE_OTEL"
"""Environment variable whose value (console|otlp) is the CLI's default ``--otel``."""

_provider: Any = None
"""The SDK ``TracerProvider`` this module owns while tracing is on; None = off."""
_tracer: Any = None


def tracing_enabled() -> bool:
    """True while ``configure_tracing`` has installed an exporter."""
    return _tracer is not None


def configure_tracing(exporter: str | None, service_name: str, *,
                      span_exporter: Any = None) -> None:
    """Turn span export on (``"console"``, ``"otlp"``) or off (``None`` or ``""``).

    ``service_name`` becomes the ``service.name`` resource attribute (e.g.
    ``"pymooncake-conductor"``). ``span_exporter`` (an ``opentelemetry.sdk`` ``SpanExporter``
    instance, e.g. ``InMemorySpanExporter`` in tests) is used instead of the named exporter,
    exported synchronously (``SimpleSpanProcessor``). A previous configuration is shut down
    (flushed) first.

    Raises ``ValueError`` for an exporter name outside ``EXPORTERS``, and ``RuntimeError``
    naming the package to install when ``opentelemetry-sdk`` (or, for ``"otlp"``,
    ``opentelemetry-exporter-otlp-proto-http``) is missing.
    """
    global _provider, _tracer
    if span_exporter is None and exporter and exporter not in EXPORTERS:
        raise ValueError(f"unknown OpenTelemetry exporter {exporter!r}: use one of "
                         f"{', '.join(EXPORTERS)} (or nothing for tracing off)")
    shutdown_tracing()
    if span_exporter is None and not exporter:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError as e:
        raise RuntimeError(f"span export needs the OpenTelemetry SDK: pip install "
                           f"opentelemetry-sdk ({e})") from None
    if span_exporter is not None:
        processor: Any = SimpleSpanProcessor(span_exporter)
    elif exporter == "console":
        processor = BatchSpanProcessor(ConsoleSpanExporter(service_name=service_name,
                                                           out=sys.stderr))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise RuntimeError(f"the otlp exporter needs: pip install "
                               f"opentelemetry-exporter-otlp-proto-http ({e})") from None
        processor = BatchSpanProcessor(OTLPSpanExporter())
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              shutdown_on_exit=False)
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("pymooncake")


def shutdown_tracing() -> None:
    """Flush the exported spans and turn tracing off. Safe to call when it is off."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()  # flushes every span processor, then shuts the exporters


def _clean(attributes: dict[str, Any]) -> dict[str, Any] | None:
    """OpenTelemetry takes str/bool/int/float (or sequences of them); drop None values."""
    return {k: v for k, v in attributes.items() if v is not None} or None


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """``with span("store.put", key=k):`` — one OpenTelemetry span around the block.

    The span is the current span inside the block (so nested ``span``/``record_span``
    calls become its children). Attributes whose value is None are left out.
    """
    if _tracer is not None:
        tracer = _tracer
    elif _otel_trace is not None:
        tracer = _otel_trace.get_tracer("pymooncake")
    else:  # pragma: no cover - depends on the environment
        yield
        return
    with tracer.start_as_current_span(name, attributes=_clean(attributes)):
        yield


def _to_ns(t_s: float) -> int:
    """Unix seconds → integer ns, whole seconds and fraction apart (``t_s * 1e9`` as a float
    would round to a multiple of 256 ns at today's epoch)."""
    whole = math.floor(t_s)
    return whole * 1_000_000_000 + round((t_s - whole) * 1e9)


def start_root_span(name: str, start_s: float | None = None, **attributes: Any) -> Any:
    """Open a span that spans await points (an async generator cannot keep a span current
    across its yields); pass it as ``parent`` to ``record_span`` and close it with
    ``end_span``. Returns None while tracing is off (every function here accepts that)."""
    tracer = _tracer
    if tracer is None:
        return None
    return tracer.start_span(name, start_time=None if start_s is None else _to_ns(start_s),
                             attributes=_clean(attributes))


def set_span_attributes(handle: Any, **attributes: Any) -> None:
    """Add attributes to a span from ``start_root_span`` (None values are left out); does
    nothing while tracing is off."""
    if handle is not None:
        handle.set_attributes(_clean(attributes) or {})


def end_span(handle: Any, end_s: float | None = None) -> None:
    """Close a span from ``start_root_span`` (at ``end_s`` Unix seconds, default now)."""
    if handle is not None:
        handle.end(end_time=None if end_s is None else _to_ns(end_s))


def record_span(name: str, start_s: float, end_s: float, parent: Any = None,
                **attributes: Any) -> None:
    """Export one finished span that ran from ``start_s`` to ``end_s``.

    Times are Unix seconds (``time.time()``), e.g. a stage a worker measured and reported as
    ``(stage, start_unix_s, end_unix_s)``; they are exported in integer nanoseconds. The
    span is a child of ``parent`` (a ``start_root_span`` handle) or else of the current
    span, if any. An ``end_s`` before ``start_s`` (a clock
    step between the two readings) is exported as a zero-length span at ``start_s``.
    Attributes whose value is None are left out. Does nothing (and checks nothing) while
    tracing is off. Raises ``ValueError`` for a non-finite time.
    """
    tracer = _tracer
    if tracer is None:
        return
    if not (math.isfinite(start_s) and math.isfinite(end_s)):
        raise ValueError(f"record_span({name!r}): times must be finite Unix seconds, "
                         f"got start_s={start_s}, end_s={end_s}")
    start_ns = _to_ns(start_s)
    end_ns = max(start_ns, _to_ns(end_s))
    context = None
    if parent is not None and _otel_trace is not None:
        context = _otel_trace.set_span_in_context(parent)
    s = tracer.start_span(name, context=context, start_time=start_ns,
                          attributes=_clean(attributes))
    s.end(end_time=end_ns)
