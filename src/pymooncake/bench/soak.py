"""``pymooncake bench soak``: trace replay across 3 namespaced hosts with a fault every few
minutes (issue 17 Build item 7).

The cluster and the faults are ``bench.soak_faults`` (two HA Store masters and the
Conductor on h1; a store-server, a prefill and a decode worker on each of h2 and h3); the
load and the Store checks ``bench.soak_checks``. Faults run one after another, in the
order given, every ``fault_every_s`` (a fault starts only once the previous one has
recovered and ``window_s`` has passed); the run lasts ``duration_s`` but always injects
every listed fault at least once. Reported: requests sent/served and failures by kind;
for each fault, the p99 TTFT (and counts) of the requests sent in the ``window_s`` before
it, between its injection and its recovery, and in the ``window_s`` after; the Store
checker's bytes verified and objects lost (must be 0).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from pymooncake.bench.soak_checks import StoreChecker, TraceLoad
from pymooncake.bench.soak_faults import FAULTS, SoakCluster

DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"


@dataclasses.dataclass(frozen=True, slots=True)
class SoakOptions:
    duration_s: float = 1800.0
    fault_every_s: float = 180.0
    faults: tuple[str, ...] = FAULTS
    model: str = "tiny"
    trace: str = DEFAULT_TRACE
    rps: float = 1.0
    """Mean request rate (Poisson arrivals), requests/s."""
    length_scale: int = 32
    """Trace lengths divided by this (``pymooncake replay --length-scale``)."""
    max_tokens: int = 32
    """Cap on a request's output tokens."""
    context: int = 2048
    window_s: float = 60.0
    """Length of the before/after windows of each fault (s), at most fault_every_s / 2."""
    request_timeout_s: float = 60.0
    seed: int = 0
    log_dir: str | None = None
    """Keep every role's output in this directory (``--keep-logs``); ``None``: discard."""

    def check(self) -> None:
        """``ValueError`` naming the first bad option."""
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if not self.fault_every_s > 0:
            raise ValueError(f"fault interval must be > 0 s, got {self.fault_every_s}")
        bad = [f for f in self.faults if f not in FAULTS]
        if bad or not self.faults:
            raise ValueError(f"unknown fault(s) {bad or '(none given)'}; known: "
                             f"{', '.join(FAULTS)}")
        if not self.rps > 0 or self.max_tokens < 1 or self.length_scale < 1:
            raise ValueError("rps must be > 0, max_tokens and length_scale >= 1")
        if 512 % self.length_scale:
            raise ValueError(f"length_scale must divide the trace block size 512, got "
                             f"{self.length_scale}")


def soak_requests(opts: SoakOptions) -> list[Any]:
    """The trace's requests materialised for the tiny model's 256-token vocabulary, output
    capped at ``max_tokens``, prompts longer than the context left out."""
    from pymooncake.workload import load_trace, materialize_trace
    trace = load_trace(opts.trace)
    reqs = materialize_trace(trace, vocab_size=256, scale=opts.length_scale, seed=opts.seed)
    out = [dataclasses.replace(r, max_tokens=min(r.max_tokens, opts.max_tokens))
           for r in reqs if len(r.token_ids) + opts.max_tokens <= opts.context]
    if not out:
        raise ValueError(f"no request of {opts.trace} fits the context {opts.context}")
    return out


def error_kind(rec: Any) -> str:
    """A failed replay record's kind: ``HTTP <status> <code>``, ``stream error <code>`` (an
    error event, with its ``code``, after tokens were streamed: a worker lost mid-decode
    is ``stream error worker_failed``) or ``no response: <exception>`` (a lost connection
    or a stream cut without its final ``[DONE]``: never expected)."""
    if rec.status == 0:
        return "no response: " + str(rec.error or "").split(":")[0]
    if rec.status == 500 and rec.token_times_s:
        return f"stream error {rec.code or '-'}"
    return f"HTTP {rec.status} {rec.code or '-'}"


def failure_list(records: list[Any], events: list[dict[str, Any]], t0: float
                 ) -> list[dict[str, Any]]:
    """Every request not served: when it was sent (s after the load began), its kind, the
    tokens it had streamed, its error, and the last fault injected before it was sent."""
    out = []
    for r in records:
        if r.served:
            continue
        before = [ev["fault"] for ev in events if ev["t_inject"] <= r.sent_s]
        out.append({"index": r.index, "sent_at_s": round(r.sent_s - t0, 2),
                    "kind": error_kind(r), "tokens_streamed": len(r.token_times_s),
                    "error": str(r.error or "")[:300],
                    "last_fault": before[-1] if before else None})
    return out


def window_stats(records: list[Any], t0: float, t1: float) -> dict[str, Any]:
    """Counts and TTFT of the requests sent in ``[t0, t1)`` (monotonic s)."""
    from pymooncake.obs.slo import percentile
    sel = [r for r in records if t0 <= r.sent_s < t1]
    ttfts = [r.ttft_s for r in sel if r.served]
    return {"sent": len(sel), "served": len(ttfts), "failed": len(sel) - len(ttfts),
            "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 4) if ttfts else None}


def run_soak(opts: SoakOptions, *, send_one: Callable[..., Any],
             new_record: Callable[..., Any], log: Callable[[str], None] = print
             ) -> dict[str, Any]:
    """Build the cluster, run the load and the faults, tear everything down; the report.
    ``send_one``/``new_record``: the replay client (``cli.replay._one``, ``ReplayRecord``).
    Raises ``RuntimeError`` when the cluster cannot start."""
    opts.check()
    requests = soak_requests(opts)
    window = min(opts.window_s, opts.fault_every_s / 2)
    cluster = SoakCluster(opts.model, opts.context, log_dir=opts.log_dir)
    t_setup = time.monotonic()
    try:
        cluster.start()
        log(f"soak: cluster up in {time.monotonic() - t_setup:.0f} s at {cluster.url}")
        checker = StoreChecker(cluster.h, cluster.store_master).start()
        load = TraceLoad(cluster.url, requests, opts.rps, send_one=send_one,
                         new_record=new_record, timeout_s=opts.request_timeout_s,
                         seed=opts.seed).start()
        t0 = time.monotonic()
        events: list[dict[str, Any]] = []
        done: collections.Counter[str] = collections.Counter()
        nxt = t0 + opts.fault_every_s
        i = 0
        while True:
            missing = [f for f in opts.faults if not done[f]]
            if nxt + window > t0 + opts.duration_s and not missing:
                break
            time.sleep(max(0.0, nxt - time.monotonic()))
            name = opts.faults[i % len(opts.faults)]
            ev = cluster.inject(name, done[name])
            done[name] += 1
            i += 1
            log(f"soak: {name} at {ev['t_inject'] - t0:.1f} s, recovered="
                f"{ev['recovered']} after {ev['t_recovered'] - ev['t_inject']:.1f} s")
            events.append(ev)
            nxt = max(nxt + opts.fault_every_s, ev["t_recovered"] + window)
        time.sleep(max(0.0, t0 + opts.duration_s - time.monotonic()))
        records = load.stop()
        t_end = time.monotonic()
        store = checker.stop(cluster.killed)
    finally:
        cluster.close()
    return report(opts, records, events, store, t0, t_end, window)


def report(opts: SoakOptions, records: list[Any], events: list[dict[str, Any]],
           store: dict[str, Any], t0: float, t_end: float, window: float) -> dict[str, Any]:
    from pymooncake.obs.slo import percentile
    served = [r for r in records if r.served]
    ttfts = [r.ttft_s for r in served]
    kinds = collections.Counter(error_kind(r) for r in records if not r.served)
    faults = []
    for ev in events:
        ti, tr = ev["t_inject"], ev["t_recovered"]
        facts = {k: v for k, v in ev.items() if k not in ("fault", "t_inject", "t_recovered")}
        faults.append({"fault": ev["fault"], "at_s": round(ti - t0, 1),
                       "recovery_s": round(tr - ti, 2), **facts,
                       "before": window_stats(records, ti - window, ti),
                       "during": window_stats(records, ti, max(tr, ti + 1e-9)),
                       "after": window_stats(records, tr, tr + window)})
    return {"model": opts.model, "hosts": 3, "duration_s": round(t_end - t0, 1),
            "fault_every_s": opts.fault_every_s, "window_s": window, "rps": opts.rps,
            "trace": opts.trace, "length_scale": opts.length_scale,
            "requests_sent": len(records), "requests_served": len(served),
            "errors_by_kind": dict(sorted(kinds.items())),
            "hung_requests": sum(1 for r in records if r.status == 0),
            "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 4) if ttfts else None,
            "faults": faults, "store": store,
            "failures": failure_list(records, events, t0)}


def format_report(rep: dict[str, Any]) -> str:
    """A Markdown rendering of ``report`` (what docs/benchmarks.md shows)."""
    def ms(v: Any) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"
    s = rep["store"]
    lines = [
        f"{rep['requests_served']} of {rep['requests_sent']} requests served in "
        f"{rep['duration_s']:.0f} s ({rep['rps']} req/s, model {rep['model']}); TTFT p50 "
        f"{ms(rep['ttft_p50_s'])} ms, p99 {ms(rep['ttft_p99_s'])} ms; hung: "
        f"{rep['hung_requests']}",
        "errors by kind: " + (", ".join(f"{k} x{n}" for k, n in rep["errors_by_kind"].items())
                              or "none"),
        f"Store: {s['objects_put']} objects put (2 replicas, pinned), {s['reads_verified']} "
        f"reads = "
        f"{s['bytes_verified']:,} bytes verified, corrupt {s['corrupt_reads']}, objects lost "
        f"{s['objects_lost']} (gone with every holder killed: "
        f"{s['objects_gone_with_every_holder']}; unreadable at the end: "
        f"{s.get('objects_unreadable_at_end', 0)}, unchecked: {s.get('objects_unchecked', 0)}"
        f"); final read errors: {s.get('final_read_errors') or 'none'}; checker errors: "
        + (", ".join(f"{k} x{n}" for k, n in s["errors_by_kind"].items()) or "none"),
        "",
        "| at (s) | fault | recovery (s) | sent/failed before | p99 TTFT before (ms) | "
        "sent/failed during | p99 TTFT during (ms) | sent/failed after | "
        "p99 TTFT after (ms) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    skip = {"fault", "at_s", "recovery_s", "before", "during", "after"}
    for f in rep["faults"]:
        b, d, a = f["before"], f["during"], f["after"]
        notes = ", ".join(f"{k}={v}" for k, v in f.items() if k not in skip)
        lines.append(f"| {f['at_s']} | {f['fault']} | {f['recovery_s']} | "
                     f"{b['sent']}/{b['failed']} | {ms(b['ttft_p99_s'])} | "
                     f"{d['sent']}/{d['failed']} | {ms(d['ttft_p99_s'])} | "
                     f"{a['sent']}/{a['failed']} | {ms(a['ttft_p99_s'])} | {notes} |")
    return "\n".join(lines)
