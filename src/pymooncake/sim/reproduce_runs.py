"""The runs behind docs/paper-reproduction.md, and the paper's values they are compared with
(read off the FAST'25 figures, ../shared/PAPER.md).

Holds ``FIG*_PAPER`` / ``FIG*_RUNS`` / ``FIG1_SYSTEMS`` and one function per figure:
``figure9`` (hit rate vs capacity), ``figure10`` (local vs global cache), ``figure5`` (TTFT
by scheduler), ``figure15`` (P/D split) and ``figure1`` (effective capacity vs TBT
threshold). ``sim.reproduce`` runs them and renders the page.
"""

from __future__ import annotations

from typing import Any

from pymooncake.obs.slo import percentile
from pymooncake.sim.capacity import capacity_curve
from pymooncake.sim.config import SimConfig
from pymooncake.sim.report import summarize
from pymooncake.sim.runner import simulate
from pymooncake.sim.sweep import sweep
from pymooncake.workload.arrival import scale_arrivals
from pymooncake.workload.stats import trace_stats
from pymooncake.workload.trace import Trace

FIG9_CAPS = (10_000, 100_000, 1_000_000, 2_000_000, 4_000_000, 5_000_000, 8_000_000,
             10_000_000, 50_000_000, 100_000_000, 500_000_000, 1_000_000_000)
FIG9_PAPER = {
    "conversation": (.0449, .0731, .0866, .1202, .2149, .2471, .2997, .3263, .3983, .4006,
                     None, .4006),
    "synthetic": (.0003, .0117, .1461, .2345, .3805, .4352, .5447, .5886, .6582, None, None,
                  .6582),
}
FIG9_PAPER_3M_LABEL = {"conversation": 0.41, "synthetic": 0.46}
FIG10_PAPER = {  # local hit, global hit, local GPU s, global GPU s
    "conversation": (0.169, 0.375, 1.379, 1.050),
    "synthetic": (0.264, 0.622, 1.497, 0.783),
}
FIG5_PAPER = {"random": (19.65, 13.72, 3.54, 29.3), "load": (5.27, 3.56, 1.05, 7.41),
              "local-cache": (3.58, 2.16, 0.56, 5.14), "global-cache": (3.07, 1.72, 0.39, 4.14)}
FIG1_PAPER = {  # TBT threshold ms -> effective capacity %, conversation
    "Mooncake": (3.5, 96.6, 99.8, 100, 100, 100, 100),
    "vLLM": (3.3, 16.1, 25.8, 38.8, 62.8, 86.4, 97.9),
    "vLLM prefix caching": (1.8, 15.1, 23.7, 34.3, 56.0, 80.8, 96.3),
    "vLLM chunked prefill": (1.2, 9.4, 17.4, 28.8, 55.4, 96.5, 100),
}
FIG1_TBT_MS = (50, 100, 150, 200, 300, 500, 1000)


def figure9(traces: dict[str, Trace]) -> dict[str, Any]:
    out = {}
    for name, t in traces.items():
        c = capacity_curve(t, FIG9_CAPS + (3_000_000,))
        out[name] = {"capacities_tokens": c.capacities_tokens[:-1], "hit_ratio": c.hit_ratio[:-1],
                     "max_hit_ratio": c.max_hit_ratio, "hit_ratio_3m": c.hit_ratio[-1],
                     "trace_cache_ratio": trace_stats(t).cache_ratio}
    return out


def figure10(traces: dict[str, Trace]) -> dict[str, Any]:
    out = {}
    for name, t in traces.items():
        row = {}
        for label, scen, sched in (("local", "pd-local", "local-cache"),
                                   ("local_load", "pd-local", "load"),
                                   ("global", "pd-global", "global-cache")):
            cfg = SimConfig(scenario=scen, scheduler=sched, num_prefill=10, num_decode=1,
                            cache_capacity_tokens=3_000_000, output_length=1,
                            sample_interval_s=0)
            s = summarize(simulate(t, cfg))
            row[label] = {"token_hit_ratio": s["token_hit_ratio"],
                          "prefill_gpu_time_mean_s": s["prefill_gpu_time_mean_s"],
                          "ttft_mean_s": s["ttft_mean_s"]}
        row["figure9_at_3m"] = capacity_curve(t, (3_000_000,)).hit_ratio[0]
        row["figure9_at_30m"] = capacity_curve(t, (30_000_000,)).hit_ratio[0]
        out[name] = row
    return out


FIG5_RUNS = (("random", "pd-local"), ("load", "pd-local"), ("local-cache", "pd-local"),
             ("global-cache", "pd-global"))


FIG5_BUSY_SCALE = 1.3
"""A second, busier replay (arrivals 1.3× faster) to show how the gaps widen with load."""


def figure5(trace: Trace) -> dict[str, Any]:
    out = {}
    busy = scale_arrivals(trace, FIG5_BUSY_SCALE)
    for sched, scen in FIG5_RUNS:
        res = simulate(trace, SimConfig(
            scenario=scen, scheduler=sched, num_prefill=8, num_decode=8,
            sample_interval_s=300.0 if sched == "global-cache" else 0.0))
        ttfts = [r.first_token_s - r.arrival_s for r in res.requests if not r.rejected]
        s = summarize(res)
        out[sched] = {"scenario": scen, "ttft_mean_s": s["ttft_mean_s"],
                      "ttft_p50_s": percentile(ttfts, 50), "ttft_q1_s": percentile(ttfts, 25),
                      "ttft_q3_s": percentile(ttfts, 75), "token_hit_ratio": s["token_hit_ratio"],
                      "hot_key_replicas": s["hot_key_replicas"],
                      "ttft_mean_busy_s": summarize(simulate(busy, SimConfig(
                          scenario=scen, scheduler=sched, num_prefill=8, num_decode=8,
                          sample_interval_s=0)))["ttft_mean_s"]}
    return out


FIG15_PAPER = {5: (77.7, 5.74, 31.5), 6: (97.2, 1.71, 31.8), 7: (99.1, 1.30, 32.9),
               8: (99.0, 1.19, 35.0), 9: (99.2, 1.12, 38.3), 10: (98.4, 1.11, 44.2),
               11: (86.1, 1.14, 58.3)}


def figure15(trace: Trace) -> dict[str, Any]:
    """P/D split of 16 nodes on the synthetic trace, TTFT <= 10 s, TBT <= 100 ms (§5.5)."""
    pts = sweep(trace, SimConfig(num_prefill=8, num_decode=8, ttft_slo_s=10.0, tbt_slo_s=0.1,
                                 sample_interval_s=0), "pd-ratio", list(FIG15_PAPER))
    return {int(p.value): {"effective_request_capacity": p.summary["slo_attainment"],
                           "ttft_mean_s": p.summary["ttft_mean_s"],
                           "tbt_mean_s": p.summary["tbt_mean_s"]} for p in pts}


FIG1_SYSTEMS = (
    ("Mooncake", dict(scenario="pd-global", scheduler="global-cache", num_prefill=8,
                      num_decode=8)),
    ("vLLM", dict(scenario="colocated", scheduler="load", num_prefill=16,
                  cache_capacity_tokens=0, chunked_prefill=False)),
    ("vLLM prefix caching", dict(scenario="colocated", scheduler="load", num_prefill=16,
                                 cache_capacity_tokens=1_000_000, chunked_prefill=False)),
    ("vLLM chunked prefill", dict(scenario="colocated", scheduler="load", num_prefill=16,
                                  cache_capacity_tokens=0, chunked_prefill=True)),
)


def figure1(trace: Trace) -> dict[str, Any]:
    out = {}
    for name, kw in FIG1_SYSTEMS:
        res = simulate(trace, SimConfig(sample_interval_s=0, **kw))
        n = len(res.requests)
        row = []
        for ms in FIG1_TBT_MS:
            ok = sum(1 for r in res.requests if not r.rejected
                     and r.first_token_s - r.arrival_s <= 30.0
                     and (r.tbt_s is None or r.tbt_s <= ms / 1000.0))
            row.append(100.0 * ok / n)
        out[name] = row
    return out
