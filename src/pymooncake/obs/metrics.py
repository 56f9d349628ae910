"""The one metrics registry of a pymooncake process (Prometheus names).

Every component records into ``REGISTRY`` through ``counter``/``gauge``/``histogram``,
which return the existing metric when the same name is asked for twice (modules may be
imported more than once, e.g. under test). Metric names are ``pymooncake_<component>_...``
with the unit as a suffix (``_seconds``, ``_bytes``, ``_total``), following the Prometheus
naming guide. ``serve_metrics(port)`` exposes the registry over HTTP (``/metrics``);
``render()`` gives the text exposition format for an existing HTTP server.

Values that cost a scan to compute (the master's objects per namespace, pins, leases) are
not kept current on a timer: ``on_collect(fn)`` runs ``fn`` each time the registry is
collected (a ``/metrics`` scrape, ``render()``), before any metric is read, so the scan
costs one pass per scrape and nothing while nobody scrapes (prometheus_client's
guidance for expensive values: compute them at collection).

``loop_counter``/``loop_histogram`` are for one thread's hot path (the RPC server's event
loop, tens of thousands of calls a second): their labelled children are plain Python
numbers that the caller bumps in place (``child.value += 1``, ``child.observe(s)``), with
no lock and no method chain, and become Prometheus samples only when the registry is
collected. A ``prometheus_client`` counter increment and histogram observation took about
1.5 µs of the master's ~3 µs of Python per metadata call (issue 16). Written from several
threads at once, an increment may be lost (never a crash, never a wrong type).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)


class _Registry(CollectorRegistry):
    """``CollectorRegistry`` that runs the ``on_collect`` refreshers before collecting."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self._refreshers: list[Callable[[], None]] = []
        self._refresh_lock = threading.Lock()

    def refresh(self) -> None:
        """Run the ``on_collect`` refreshers (each failure is logged, not raised)."""
        with self._refresh_lock:
            fns = list(self._refreshers)
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a failed refresh serves the last values
                logger.exception("metrics refresh %r failed", fn)

    def collect(self) -> Iterator[Metric]:
        self.refresh()
        yield from super().collect()

    def restricted_registry(self, names: Any) -> Any:
        """As ``CollectorRegistry``'s (a ``/metrics?name[]=…`` scrape), refreshed first: its
        ``collect`` reads the collectors directly, not through ``collect`` above."""
        self.refresh()
        return super().restricted_registry(names)


REGISTRY = _Registry()
_lock = threading.Lock()


def on_collect(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` (no arguments; any thread: the one collecting) before every collection
    of ``REGISTRY``; returns a function that removes it again. ``fn`` should set gauges;
    an exception it raises is logged and the previous values are served."""
    with REGISTRY._refresh_lock:
        REGISTRY._refreshers.append(fn)

    def remove() -> None:
        with REGISTRY._refresh_lock:
            if fn in REGISTRY._refreshers:
                REGISTRY._refreshers.remove(fn)
    return remove


_metrics: dict[str, Counter | Gauge | Histogram | LoopCounter | LoopHistogram] = {}

# Latency buckets (seconds) from 50 µs to 60 s, for RPCs, transfers, TTFT and TBT.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def _once(kind: type, name: str, make: Any) -> Any:
    """The metric registered as ``name`` (it must be a ``kind``), or ``make()``'s, which
    is then registered in ``REGISTRY``."""
    with _lock:
        existing = _metrics.get(name)
        if existing is not None:
            if not isinstance(existing, kind):
                raise ValueError(f"metric {name!r} already registered as {type(existing).__name__}")
            return existing
        metric = make()
        _metrics[name] = metric
        return metric


def _get(kind: type, name: str, doc: str, labels: Sequence[str], **kw: object):
    return _once(kind, name, lambda: kind(name, doc, labelnames=tuple(labels),
                                          registry=REGISTRY, **kw))


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


class LoopCounterChild:
    """One label set's count: ``child.value += n`` on the hot path."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class LoopHistogramChild:
    """One label set's distribution: ``counts[i]`` observations in bucket ``i`` (not
    cumulative; the last is +Inf) and their ``sum``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _LoopMetric:
    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labels)
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        """The child of these label values (created once, then cached)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values, got "
                             f"{len(values)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, self._child())
        return child

    def _child(self) -> Any:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Any:
        raise NotImplementedError


class LoopCounter(_LoopMetric):
    """A labelled counter with lock-free children (see the module docstring)."""

    def _child(self) -> LoopCounterChild:
        return LoopCounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.doc, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        for key, child in list(self._children.items()):
            fam.add_metric(list(key), child.value)
        yield fam


class LoopHistogram(_LoopMetric):
    """A labelled histogram with lock-free children (see the module docstring)."""

    def __init__(self, name: str, doc: str, labels: Sequence[str],
                 buckets: Sequence[float]) -> None:
        super().__init__(name, doc, labels)
        self.bounds = tuple(sorted(float(b) for b in buckets))

    def _child(self) -> LoopHistogramChild:
        return LoopHistogramChild(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        for key, child in list(self._children.items()):
            counts, total, acc = list(child.counts), child.sum, 0
            buckets = []
            for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
                acc += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            fam.add_metric(list(key), buckets, total)
        yield fam


def _get_loop(kind: type, name: str, *args: Any) -> Any:
    def make() -> Any:
        metric = kind(name, *args)
        REGISTRY.register(metric)
        return metric
    return _once(kind, name, make)


def loop_counter(name: str, doc: str, labels: Sequence[str] = ()) -> LoopCounter:
    """A counter for one thread's hot path (module docstring); ``name`` ends in ``_total``."""
    return _get_loop(LoopCounter, name, doc, labels)


def loop_histogram(name: str, doc: str, labels: Sequence[str] = (),
                   buckets: Sequence[float] = LATENCY_BUCKETS_S) -> LoopHistogram:
    """A histogram for one thread's hot path (module docstring)."""
    return _get_loop(LoopHistogram, name, doc, labels, buckets)


def render() -> bytes:
    """The registry in the Prometheus text exposition format."""
    return generate_latest(REGISTRY)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` for this process's registry on ``host:port`` (a daemon thread)."""
    start_http_server(port, addr=host, registry=REGISTRY)
