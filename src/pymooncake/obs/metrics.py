"""The one metrics registry of a pymooncake process (Prometheus names).

Every component records into ``REGISTRY`` through ``counter``/``gauge``/``histogram``,
which return the existing metric when the same name is asked for twice (modules may be
imported more than once, e.g. under test). Metric names are ``pymooncake_<component>_...``
with the unit as a suffix (``_seconds``, ``_bytes``, ``_total``), following the Prometheus
naming guide. ``serve_metrics(port)`` exposes the registry over HTTP (``/metrics``);
``render()`` gives the text exposition format for an existing HTTP server.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

REGISTRY = CollectorRegistry(auto_describe=True)
_lock = threading.Lock()
_metrics: dict[str, Counter | Gauge | Histogram] = {}

# Latency buckets (seconds) from 50 µs to 60 s, for RPCs, transfers, TTFT and TBT.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def _get(kind: type, name: str, doc: str, labels: Sequence[str], **kw: object):
    with _lock:
        existing = _metrics.get(name)
        if existing is not None:
            if not isinstance(existing, kind):
                raise ValueError(f"metric {name!r} already registered as {type(existing).__name__}")
            return existing
        metric = kind(name, doc, labelnames=tuple(labels), registry=REGISTRY, **kw)
        _metrics[name] = metric
        return metric


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    """A monotonically increasing count; ``name`` should end in ``_total``."""
    return _get(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    """A value that goes up and down (bytes used, queue length)."""
    return _get(Gauge, name, doc, labels)


def histogram(name: str, doc: str, labels: Sequence[str] = (),
              buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
    """A distribution; latencies in seconds with ``LATENCY_BUCKETS_S`` by default."""
    return _get(Histogram, name, doc, labels, buckets=tuple(buckets))


def render() -> bytes:
    """The registry in the Prometheus text exposition format."""
    return generate_latest(REGISTRY)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` for this process's registry on ``host:port`` (a daemon thread)."""
    start_http_server(port, addr=host, registry=REGISTRY)
