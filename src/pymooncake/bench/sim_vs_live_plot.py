"""Figures of the calibrated simulator (matplotlib, PNG): simulated p90 TTFT against the live
``bench capacity`` results, and the simulated scale-out sweep in the shape of the paper's
Figure 6 (p90 TTFT and p90 TBT against rate, thresholds drawn, capacity marked)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from pymooncake.bench import capacity as cap

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _plt():  # noqa: ANN202
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_vs_live(live: dict[str, Any], sim: dict[str, Any], out: str | Path) -> Path:
    """One panel per trace: live median p90 TTFT (min–max over repeats) as markers, the
    simulated p90 TTFT as a dashed line of the same colour, the live thresholds dotted."""
    plt = _plt()
    traces = sim["config"]["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(max(9, 6 * len(traces)), 4.6),
                             squeeze=False)
    for ax, label in zip(axes[0], traces, strict=True):
        for i, system in enumerate(sim["config"]["systems"]):
            c = COLORS[i % len(COLORS)]
            lv = [r for r in cap.rate_curves(live, label, system, "ttft_p90_s") if "median" in r]
            if lv:
                ax.errorbar([r["rate"] for r in lv], [r["median"] for r in lv],
                            yerr=[[r["median"] - r["min"] for r in lv],
                                  [r["max"] - r["median"] for r in lv]],
                            fmt="o", color=c, capsize=3, label=f"{system} live")
            sv = [r for r in cap.rate_curves(sim, label, system, "ttft_p90_s") if "median" in r]
            if sv:
                ax.plot([r["rate"] for r in sv], [r["median"] for r in sv], "--", color=c,
                        label=f"{system} simulated")
        if live.get("solo", {}).get(label):
            base = cap.solo_base(live["solo"][label])
            for m in live["config"]["multiples"]:
                ax.axhline(m * base["ttft_p90_s"], color="grey", ls=":", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("p90 TTFT (s)")
        lc = live["config"]
        ax.set_title(f"{label}: calibrated simulator vs live ({lc.get('requests')} requests "
                     f"per point, {lc.get('repeats')} repeat(s))", fontsize=10)
        ax.legend(fontsize=7)
    cal = sim.get("calibration", {})
    label = textwrap.fill(textwrap.shorten(cal.get("label") or cal.get("path") or "", 200),
                          110)
    fig.suptitle(f"p90 TTFT, simulated against live\ncalibration: {label}", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_scale_out(doc: dict[str, Any], out: str | Path) -> Path:
    """SIMULATED Figure 6: p90 TTFT (top) and p90 TBT (bottom) against rate per system and
    trace; the thresholds (multiples of the simulated solo base) dotted; each system's
    capacity at the strictest pair where some system has one marked by a vertical line; a
    cross marks a rate where more than 10 % of the requests were rejected."""
    plt = _plt()
    an = cap.analyze(doc)
    traces = doc["config"]["traces"]
    fig, axes = plt.subplots(2, len(traces), figsize=(max(9, 6 * len(traces)), 7.5),
                             squeeze=False)
    for j, label in enumerate(traces):
        base = an[label]["base"]
        pair = next((p for p in an[label]["pairs"]
                     if any(v["median"] > 0 for v in p["capacity"].values())), None)
        for row, (key, unit) in enumerate((("ttft_p90_s", "p90 TTFT (s)"),
                                           ("tbt_p90_s", "p90 TBT (s)"))):
            ax = axes[row][j]
            for i, system in enumerate(doc["config"]["systems"]):
                c = COLORS[i % len(COLORS)]
                pts = [r for r in cap.rate_curves(doc, label, system, key) if "median" in r]
                ax.plot([r["rate"] for r in pts], [r["median"] for r in pts], "-", color=c,
                        label=system)
                for ok, mk in ((True, "o"), (False, "x")):
                    sel = [r for r in pts if r["admitted_ok"] is ok]
                    ax.plot([r["rate"] for r in sel], [r["median"] for r in sel], mk, color=c)
                if pair and pair["capacity"].get(system, {}).get("median", 0) > 0:
                    ax.axvline(pair["capacity"][system]["median"], color=c, ls="--", lw=1)
            for m in doc["config"]["multiples"]:
                lim = m * base[key]
                ax.axhline(lim, color="grey", ls=":", lw=0.8)
                ax.annotate(f"{m:g}x", (ax.get_xlim()[0], lim), fontsize=7, color="grey")
            ax.set_yscale("log")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel(unit)
            if row == 0:
                where = (f"capacity (dashed) at TTFT {pair['ttft_multiple']:g}x, TBT "
                         f"{pair['tbt_multiple']:g}x" if pair else "no capacity")
                ax.set_title(f"{label} — SIMULATED; {where}", fontsize=9)
            ax.legend(fontsize=7)
    label = textwrap.shorten(doc.get("calibration", {}).get("label", ""), 150)
    fig.suptitle("SIMULATED with CPU-calibrated costs (not measured); x = more than 10 % "
                 f"rejected\ncalibration: {label}", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
