"""Transfer Engine metrics (Prometheus, through the one registry of ``pymooncake.obs``)."""

from __future__ import annotations

from pymooncake.obs import metrics

TRANSFER_BYTES = "pymooncake_transfer_bytes_total"
TRANSFER_SLICES = "pymooncake_transfer_slices_total"
TRANSFER_RETRIES = "pymooncake_transfer_retries_total"
TRANSFER_RECONNECTS = "pymooncake_transfer_stale_reconnects_total"
TRANSFER_FAILURES = "pymooncake_transfer_failed_requests_total"
TRANSFER_LATENCY = "pymooncake_transfer_request_latency_seconds"
TRANSFER_WINDOW_LATENCY = "pymooncake_transfer_window_latency_seconds"

bytes_total = metrics.counter(TRANSFER_BYTES, "Bytes moved by the Transfer Engine",
                              ("transport", "path"))
slices_total = metrics.counter(TRANSFER_SLICES, "Slices completed", ("transport", "path"))
retries_total = metrics.counter(TRANSFER_RETRIES, "Slices re-sent after a path error",
                                ("transport", "path"))
reconnects_total = metrics.counter(
    TRANSFER_RECONNECTS, "Pooled connections found closed by the peer and reopened", ("path",))
failures_total = metrics.counter(TRANSFER_FAILURES, "Requests that ended failed",
                                 ("transport", "code"))
latency_seconds = metrics.histogram(TRANSFER_LATENCY, "Submit-to-completion time of a request",
                                    ("transport",))
window_latency_seconds = metrics.histogram(
    TRANSFER_WINDOW_LATENCY, "Time one path takes to send a window of slices and get the "
    "replies", ("transport", "path"))


def observe_many(hist: object, value: float, n: int) -> None:
    """``hist.observe(value)`` ``n`` times, in one update when the client allows it.

    Requests of one submission that finish together share one latency; a batch of 128
    small requests then costs one histogram update instead of 128. Falls back to ``n``
    observations on a client whose histogram internals differ.
    """
    buckets = getattr(hist, "_buckets", None)
    bounds = getattr(hist, "_upper_bounds", None)
    total = getattr(hist, "_sum", None)
    if n == 1 or buckets is None or bounds is None or total is None:
        for _ in range(n):
            hist.observe(value)  # type: ignore[attr-defined]
        return
    total.inc(value * n)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(n)
            break
