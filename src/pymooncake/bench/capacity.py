"""``pymooncake bench capacity``: effective request capacity, live (paper §5.2.2 / §8.1,
Figures 1, 6, 7), issue 15 items 3-4 — the pure part.

The harness (``capacity_run``) replays a trace sample at a sweep of arrival rates through
each system and records, per (trace, system, rate, repeat) *point*, every request's status,
TTFT and TBT (``obs.slo``: TBT = mean of the longest 10 % of its token intervals). This
module turns that document into the figures:

* ``summarize_point``: p50/p90/p99 TTFT and TBT over the served requests, rejected
  (HTTP 429/503) and failed (anything else, timeouts included) counts;
* ``thresholds``: per trace, every pair (TTFT ``m1`` x base, TBT ``m2`` x base) of the
  multiples, the base of each metric being its *single-request* value measured in the same
  run: the p90 over the sample's first requests sent one at a time, the lowest over the
  systems (the best this machine does);
* ``capacity``: the highest swept rate whose p90 TTFT and p90 TBT are within a pair with at
  most 10 % of requests rejected or failed (0 when no rate is); per repeat, then the median
  and the spread (min-max) over the repeats;
* ``margins``: each of our systems against the best vLLM configuration at every pair; the
  margin is "not distinguishable" when the repeats' spreads overlap (no verdict from a
  single repeat).

Everything here is plain arithmetic on the recorded JSON (CI tests it on a recorded sample);
only ``capacity_run`` starts processes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from pymooncake.obs.slo import percentile

DOC_KIND = "pymooncake-bench-capacity"
DOC_VERSION = 1
MAX_BAD_FRACTION = 0.10
"""A rate counts only when at most this share of its requests was rejected or failed."""
OURS = ("ours-colocated", "ours-1w", "ours-pd")
PEER_PREFIX = "vllm"
"""Systems named ``vllm...`` (vllm, vllm-t<N>, vllm-b<M>, vllm-2x1) are the peer's
configurations."""
REJECT_STATUSES = (429, 503)
PERCENTILES = (50, 90, 99)


def _pct(xs: Sequence[float], q: float) -> float | None:
    return percentile(list(xs), q) if xs else None


def summarize_point(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and percentiles of one point from its per-request records.

    A record: ``status`` (HTTP status, 0 = no response or timed out), ``ttft_s`` and
    ``tbt_s`` (``None`` unless served; ``tbt_s`` also ``None`` for a single-token output),
    ``cached_tokens``, ``prompt_tokens``. Served = status 200 with a first token.
    """
    served = [r for r in records if r.get("status") == 200 and r.get("ttft_s") is not None]
    rejected = sum(r.get("status") in REJECT_STATUSES for r in records)
    ttfts = [float(r["ttft_s"]) for r in served]
    tbts = [float(r["tbt_s"]) for r in served if r.get("tbt_s") is not None]
    n = len(records)
    out: dict[str, Any] = {
        "num_requests": n, "num_served": len(served), "num_rejected": rejected,
        "num_failed": n - len(served) - rejected,
        "bad_fraction": (n - len(served)) / n if n else 1.0}
    for q in PERCENTILES:
        out[f"ttft_p{q}_s"] = _pct(ttfts, q)
        out[f"tbt_p{q}_s"] = _pct(tbts, q)
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in served)
    cached = sum(int(r.get("cached_tokens") or 0) for r in served)
    out["token_hit_ratio"] = cached / prompt if prompt else 0.0
    return out


def point_ok(summary: dict[str, Any], ttft_limit_s: float, tbt_limit_s: float) -> bool:
    """True when the point meets the pair: ≤ 10 % rejected or failed, p90 TTFT and p90 TBT
    within the limits (a point whose outputs were all single tokens has no TBT: TTFT only)."""
    if summary.get("skipped") or summary["num_requests"] == 0:
        return False
    if summary["bad_fraction"] > MAX_BAD_FRACTION + 1e-12:
        return False
    ttft, tbt = summary.get("ttft_p90_s"), summary.get("tbt_p90_s")
    if ttft is None or ttft > ttft_limit_s:
        return False
    return tbt is None or tbt <= tbt_limit_s


def capacity(points: Iterable[tuple[float, dict[str, Any]]], ttft_limit_s: float,
             tbt_limit_s: float) -> float:
    """Highest rate among ``(rate, summary)`` whose summary meets the pair; 0.0 for none."""
    return max((rate for rate, s in points if point_ok(s, ttft_limit_s, tbt_limit_s)),
               default=0.0)


def solo_base(solo: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The single-request base of one trace from each system's solo summary: the lowest p90
    TTFT and the lowest p90 TBT over the systems, with the system each came from."""
    ttft = [(s["ttft_p90_s"], name) for name, s in solo.items() if s.get("ttft_p90_s")]
    tbt = [(s["tbt_p90_s"], name) for name, s in solo.items() if s.get("tbt_p90_s")]
    if not ttft or not tbt:
        raise ValueError("no system served a solo request: no single-request base")
    (t1, n1), (t2, n2) = min(ttft), min(tbt)
    return {"ttft_p90_s": t1, "ttft_from": n1, "tbt_p90_s": t2, "tbt_from": n2}


def thresholds(base: dict[str, Any], multiples: Sequence[float]) -> list[dict[str, Any]]:
    """Every (TTFT multiple, TBT multiple) pair, strictest first (by the larger multiple,
    then the sum), with its limits in seconds."""
    pairs = sorted(((a, b) for a in multiples for b in multiples),
                   key=lambda p: (max(p), p[0] + p[1], p))
    return [{"ttft_multiple": a, "tbt_multiple": b, "ttft_limit_s": a * base["ttft_p90_s"],
             "tbt_limit_s": b * base["tbt_p90_s"]} for a, b in pairs]


def spread(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": list(values)}


def _points(doc: dict[str, Any], trace: str, system: str) -> dict[int, list[tuple[float, dict]]]:
    """repeat -> [(rate, summary)] of one trace and system."""
    out: dict[int, list[tuple[float, dict]]] = {}
    for p in doc["points"]:
        if p["trace"] == trace and p["system"] == system:
            out.setdefault(int(p["repeat"]), []).append((float(p["rate"]), p["summary"]))
    return out


def rate_curves(doc: dict[str, Any], trace: str, system: str, key: str
                ) -> list[dict[str, Any]]:
    """Per swept rate: the median, min and max of ``summary[key]`` over the repeats that
    measured it, and whether every repeat had ≤ 10 % rejected or failed."""
    by_rate: dict[float, list[dict]] = {}
    for pts in _points(doc, trace, system).values():
        for rate, s in pts:
            by_rate.setdefault(rate, []).append(s)
    out = []
    for rate in sorted(by_rate):
        vals = [s[key] for s in by_rate[rate] if not s.get("skipped") and s.get(key) is not None]
        row: dict[str, Any] = {"rate": rate, "n": len(vals), "admitted_ok": all(
            not s.get("skipped") and s["bad_fraction"] <= MAX_BAD_FRACTION
            for s in by_rate[rate])}
        if vals:
            row |= spread(vals)
        out.append(row)
    return out


def analyze(doc: dict[str, Any]) -> dict[str, Any]:
    """``{trace: {"base", "pairs": [{pair..., "capacity": {system: spread}, "margins"}],
    "headline"}}`` of a capacity document."""
    multiples = doc["config"]["multiples"]
    systems = doc["config"]["systems"]
    out: dict[str, Any] = {}
    for trace in doc["config"]["traces"]:
        base = solo_base(doc["solo"][trace])
        pairs = []
        for th in thresholds(base, multiples):
            caps = {}
            for system in systems:
                reps = _points(doc, trace, system)
                if reps:
                    caps[system] = spread([capacity(pts, th["ttft_limit_s"], th["tbt_limit_s"])
                                           for _, pts in sorted(reps.items())])
            pairs.append(th | {"capacity": caps, "margins": margins(caps)})
        out[trace] = {"base": base, "pairs": pairs, "headline": headline(pairs)}
    return out


def margins(caps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each of our systems against the best vLLM configuration (highest median capacity)."""
    peers = [p for p in caps if p.startswith(PEER_PREFIX)]
    if not peers:
        return {}
    best = max(peers, key=lambda p: (caps[p]["median"], caps[p]["max"]))
    out = {}
    for ours in [*(s for s in OURS if s in caps),
                 *sorted(s for s in caps if s.startswith("ours-1w-"))]:
        a, b = caps[ours], caps[best]
        ratio = a["median"] / b["median"] if b["median"] > 0 else (
            math.inf if a["median"] > 0 else None)
        if min(len(a["values"]), len(b["values"])) < 2:
            verdict = "one repeat: no spread"
        elif a["min"] > b["max"]:
            verdict = "higher"
        elif a["max"] < b["min"]:
            verdict = "lower"
        else:
            verdict = "not distinguishable"
        out[ours] = {"vs": best, "ratio": ratio, "verdict": verdict}
    return out


def headline(pairs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """At the strictest pair where some vLLM configuration has a capacity above 0: our best
    system's ratio and verdict there (None when vLLM serves nothing at any pair)."""
    for p in pairs:
        if not any(c["median"] > 0 for s, c in p["capacity"].items()
                   if s.startswith(PEER_PREFIX)):
            continue
        if not p["margins"]:
            return None
        ours = max(p["margins"], key=lambda s: p["capacity"][s]["median"])
        return {"ttft_multiple": p["ttft_multiple"], "tbt_multiple": p["tbt_multiple"],
                "system": ours, **p["margins"][ours]}
    return None


def check_doc(doc: Any) -> dict[str, Any]:
    """Raise ``ValueError`` unless ``doc`` looks like a capacity document; return it."""
    if not isinstance(doc, dict) or doc.get("kind") != DOC_KIND:
        raise ValueError(f"not a {DOC_KIND} document")
    if doc.get("version") != DOC_VERSION:
        raise ValueError(f"document version {doc.get('version')!r}, expected {DOC_VERSION}")
    for key in ("config", "solo", "points", "provenance"):
        if key not in doc:
            raise ValueError(f"capacity document without {key!r}")
    if not isinstance(doc["points"], list) or not isinstance(doc["solo"], dict):
        raise ValueError("capacity document: 'points' must be a list and 'solo' an object")
    for i, p in enumerate(doc["points"]):
        where = f"points[{i}]"
        if not isinstance(p, dict) or not isinstance(p.get("summary"), dict):
            raise ValueError(f"{where}: not an object with a 'summary' object")
        for key in ("trace", "system"):
            if not isinstance(p.get(key), str):
                raise ValueError(f"{where}.{key}: expected a string, got {p.get(key)!r}")
        if not _number(p.get("rate")) or p["rate"] <= 0:
            raise ValueError(f"{where}.rate: expected a number > 0, got {p.get('rate')!r}")
        _check_summary(p["summary"], f"{where}.summary")
    for trace, systems in doc["solo"].items():
        if not isinstance(systems, dict):
            raise ValueError(f"solo.{trace}: expected an object of systems")
        for name, summ in systems.items():
            if not isinstance(summ, dict):
                raise ValueError(f"solo.{trace}.{name}: expected an object")
            _check_summary(summ, f"solo.{trace}.{name}", counts=False)
    return doc


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_summary(summ: dict[str, Any], where: str, counts: bool = True) -> None:
    """The summary fields the analysis reads: p90 seconds (a number >= 0 or null) and, for a
    swept point that ran (not ``skipped``), its request count and bad fraction."""
    for key in ("ttft_p90_s", "tbt_p90_s"):
        v = summ.get(key)
        if v is not None and (not _number(v) or v < 0):
            raise ValueError(f"{where}.{key}: expected seconds >= 0 or null, got {v!r}")
    if counts and not summ.get("skipped"):
        n, bad = summ.get("num_requests"), summ.get("bad_fraction")
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise ValueError(f"{where}.num_requests: expected an integer >= 0, got {n!r}")
        if n and not (_number(bad) and 0 <= bad <= 1):
            raise ValueError(f"{where}.bad_fraction: expected a number in [0, 1], got {bad!r}")


def _f(v: Any, unit: str = "") -> str:
    return "-" if v is None else f"{v:.3g}{unit}"


def format_table(doc: dict[str, Any], analysis: dict[str, Any]) -> str:
    """The capacity table of every trace (req/s: median [min-max] over the repeats)."""
    cfg = doc["config"]
    systems = cfg["systems"]
    lines = [f"model {cfg['model']}, cores {cfg['cores']}, length scale {cfg['length_scale']}"
             f", {cfg['requests_per_point']} requests per point ({cfg['subsample']}), "
             f"{cfg['repeats']} repeat(s), rates {cfg['rates']} req/s"]
    for trace, a in analysis.items():
        b = a["base"]
        lines.append(f"\n{trace}: single-request p90 TTFT {b['ttft_p90_s']:.3f} s "
                     f"({b['ttft_from']}), p90 TBT {1e3 * b['tbt_p90_s']:.1f} ms "
                     f"({b['tbt_from']})")
        lines.append(f"{'TTFTxTBT':<10}{'limits':>18}" + "".join(f"{s:>22}" for s in systems)
                     + "  margin (ours vs best vLLM)")
        for p in a["pairs"]:
            cells = []
            for s in systems:
                c = p["capacity"].get(s)
                cells.append(f"{'-':>22}" if c is None else
                             f"{c['median']:>8.3g} [{c['min']:.3g}-{c['max']:.3g}]".rjust(22))
            mg = "; ".join(f"{o} {_f(m['ratio'], 'x')} vs {m['vs']} ({m['verdict']})"
                           for o, m in p["margins"].items())
            lim = f"{p['ttft_limit_s']:.2f}s/{1e3 * p['tbt_limit_s']:.0f}ms"
            lines.append(f"{p['ttft_multiple']:g}x{p['tbt_multiple']:g}x".ljust(10)
                         + f"{lim:>18}" + "".join(cells) + "  " + mg)
        h = a["headline"]
        lines.append("headline: " + ("vLLM has no capacity at any pair" if h is None else
                     f"at {h['ttft_multiple']:g}x/{h['tbt_multiple']:g}x (strictest pair "
                     f"where vLLM serves) {h['system']} / {h['vs']} = {_f(h['ratio'], 'x')}"
                     f" ({h['verdict']})"))
    return "\n".join(lines)
