"""The capacity experiment's figure (issue 15 item 4), the shape of the paper's Figure 6:
per trace, p90 TTFT and p90 TBT against the arrival rate, one line per system (median over
the repeats, bars = min-max), the threshold lines (multiples of the single-request value),
and each system's effective capacity at one threshold pair marked on the rate axis. A point
with more than 10 % of its requests rejected or failed is drawn hollow (it cannot count
toward capacity whatever its latency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pymooncake.bench import capacity as cap

COLORS = {"vllm": "tab:blue", "vllm-2x1": "tab:cyan", "ours-colocated": "tab:orange",
          "ours-1w": "tab:olive", "ours-pd": "tab:red"}


def marked_pair(analysis_trace: dict[str, Any], ttft_multiple: float, tbt_multiple: float
                ) -> dict[str, Any]:
    """The pair of ``analysis[trace]["pairs"]`` with these multiples (``KeyError`` if none)."""
    for p in analysis_trace["pairs"]:
        if p["ttft_multiple"] == ttft_multiple and p["tbt_multiple"] == tbt_multiple:
            return p
    raise KeyError(f"no threshold pair {ttft_multiple:g}x/{tbt_multiple:g}x")


def plot_trace(doc: dict[str, Any], analysis: dict[str, Any], trace: str, out: str | Path,
               mark: tuple[float, float] | None = None) -> Path:
    """Draw ``trace``'s figure into the PNG ``out``; ``mark`` = the (TTFT, TBT) multiples
    whose capacities are marked (default: the middle multiple for both)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiples = sorted(doc["config"]["multiples"])
    if mark is None:
        mid = multiples[len(multiples) // 2]
        mark = (mid, mid)
    a = analysis[trace]
    pair = marked_pair(a, *mark)
    base = a["base"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, scale, unit, base_key, lim_key in (
            (axes[0], "ttft_p90_s", 1.0, "s", "ttft_p90_s", "ttft_limit_s"),
            (axes[1], "tbt_p90_s", 1e3, "ms", "tbt_p90_s", "tbt_limit_s")):
        for system in doc["config"]["systems"]:
            rows = [r for r in cap.rate_curves(doc, trace, system, key) if r["n"]]
            if not rows:
                continue
            color = COLORS.get(system)
            xs = [r["rate"] for r in rows]
            ys = [r["median"] * scale for r in rows]
            err = [[(r["median"] - r["min"]) * scale for r in rows],
                   [(r["max"] - r["median"]) * scale for r in rows]]
            c = pair["capacity"].get(system)
            label = system + (f" (capacity {c['median']:g} req/s)" if c else "")
            line = ax.errorbar(xs, ys, yerr=err, marker="o", ms=5, capsize=3, color=color,
                               label=label, mfc="none")
            col = line[0].get_color()
            full = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r["admitted_ok"]]
            if full:
                ax.plot(*zip(*full, strict=True), "o", ms=5, color=col)
            if c and c["median"] > 0:
                ax.axvline(c["median"], color=col, ls=":", lw=1.2)
        for m in multiples:
            ax.axhline(m * base[base_key] * scale, color="gray", ls="--", lw=0.8)
            ax.annotate(f"{m:g}x", (1.0, m * base[base_key] * scale),
                        xycoords=("axes fraction", "data"), fontsize=8, color="gray",
                        ha="left", va="center")
        ax.axhline(pair[lim_key] * scale, color="black", ls="--", lw=1.2)
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"p90 {key.split('_')[0].upper()} ({unit})")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="best")
    cfg = doc["config"]
    fig.suptitle(f"{trace}: p90 TTFT and TBT vs arrival rate, {cfg['model']} float32 on cores "
                 f"{cfg['cores']}, {cfg['requests_per_point']} requests per point, "
                 f"{cfg['repeats']} repeat(s) (cf. Mooncake Figure 6)\n"
                 f"dashed: {', '.join(f'{m:g}x' for m in multiples)} the single-request p90 "
                 f"({base['ttft_p90_s']:.2f} s / {1e3 * base['tbt_p90_s']:.0f} ms), bold = "
                 f"{mark[0]:g}x TTFT / {mark[1]:g}x TBT; dotted: capacity there; hollow: "
                 f"> 10 % rejected or failed", fontsize=9)
    fig.tight_layout()
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_all(doc: dict[str, Any], analysis: dict[str, Any], out_dir: str | Path,
             prefix: str = "capacity", mark: tuple[float, float] | None = None) -> list[Path]:
    """One PNG per trace, ``<out_dir>/<prefix>_<trace>.png``."""
    return [plot_trace(doc, analysis, t, Path(out_dir) / f"{prefix}_{t}.png", mark)
            for t in analysis]
