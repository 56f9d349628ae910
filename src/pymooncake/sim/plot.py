"""Paper-style figures with matplotlib (Agg backend) to PNG: hit rate vs capacity (Figure 9),
TTFT by scheduler (Figure 5), effective request capacity vs TBT threshold (Figure 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pymooncake.sim.capacity import DEFAULT_CAPACITIES_TOKENS, capacity_curve
from pymooncake.sim.config import SimConfig
from pymooncake.sim.runner import simulate
from pymooncake.workload.trace import Trace

PLOT_KINDS = ("capacity", "schedulers", "tbt")


def plot(trace: Trace, kind: str, out: str | Path, base: SimConfig | None = None) -> Path:
    """Draw ``kind`` for ``trace`` into the PNG ``out`` and return its path.

    ``base`` gives the cluster for "schedulers" (its P/D counts; the schedulers vary) and "tbt"
    (the disaggregated system; a colocated vLLM-like cluster of as many nodes is drawn beside).
    Raises ``ValueError`` for an unknown kind.
    """
    if kind not in PLOT_KINDS:
        raise ValueError(f"unknown plot kind {kind!r}; use one of {PLOT_KINDS}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = base or SimConfig()
    base = dataclasses.replace(base, sample_interval_s=0)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if kind == "capacity":
        c = capacity_curve(trace, DEFAULT_CAPACITIES_TOKENS)
        ax.semilogx(c.capacities_tokens, c.hit_ratio, marker="o", label="LRU hit ratio")
        ax.axhline(c.max_hit_ratio, ls=":", color="gray", label=f"max {c.max_hit_ratio:.3f}")
        ax.axvline(3e6, ls="--", color="red", label="3M tokens (one node's DRAM)")
        ax.set_xlabel("cache capacity (tokens)")
        ax.set_ylabel("token-weighted hit ratio")
        ax.set_title("Hit ratio vs cache capacity (cf. Mooncake Figure 9)")
        ax.legend()
    elif kind == "schedulers":
        data, labels = [], []
        for sched, scen in (("random", "pd-local"), ("load", "pd-local"),
                            ("local-cache", "pd-local"), ("global-cache", "pd-global")):
            res = simulate(trace, dataclasses.replace(base, scheduler=sched, scenario=scen))
            data.append([r.first_token_s - r.arrival_s for r in res.requests if not r.rejected])
            labels.append(sched)
        ax.boxplot(data, showfliers=False, showmeans=True)
        ax.set_xticks(range(1, len(labels) + 1), labels)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"TTFT by prefill scheduler, {base.num_prefill}P{base.num_decode}D "
                     "(cf. Figure 5)")
    else:
        thresholds = [0.025 * i for i in range(1, 41)]
        colo = dataclasses.replace(base, scenario="colocated", scheduler="load",
                                   num_prefill=base.num_prefill + base.num_decode,
                                   cache_capacity_tokens=0, chunked_prefill=False)
        for name, cfg in (("P/D (this config)", base), ("colocated, no chunking", colo)):
            res = simulate(trace, cfg)
            n = len(res.requests)
            ys = [100.0 * sum(1 for r in res.requests if not r.rejected
                              and r.first_token_s - r.arrival_s <= cfg.ttft_slo_s
                              and (r.tbt_s is None or r.tbt_s <= x)) / n for x in thresholds]
            ax.plot([1000 * x for x in thresholds], ys, label=name)
        ax.set_xlabel("TBT threshold (ms)")
        ax.set_ylabel("effective request capacity (%)")
        ax.set_title("Effective request capacity vs TBT threshold (cf. Figure 1)")
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = Path(out)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
