"""``pymooncake bench serving --paired K``: every configuration's cluster up at once, the
trace replayed in ``K`` slices that the configurations take in turn.

Why: a replay lasts ~100 s, and on a shared VM the same requests took 40-48 CPU-s of one
cluster from one replay to the next (issue 16, session 33), more than the 5 % the P/D
CPU figure is judged by. Replayed slice by slice in turn (A B, B A, A B, ...), both
clusters meet the same minutes of the host. Each slice is ``pymooncake replay --limit
HI --skip LO`` (the same tokens as in a whole replay, timed from the slice's first
arrival); a slice's requests all finish before the next slice starts, so a cluster is
drained at each of its ``K - 1`` slice boundaries (a whole replay lets them overlap).
A cluster's CPU is counted over its own slices only (the idle cluster's background CPU
while the other works, ~0.02 CPU-s a second, is nobody's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from contextlib import ExitStack
from typing import Any

from pymooncake.bench.transfer import spread
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import PARENT_ENV, LocalCluster

SUM_KEYS = ("num_requests", "num_served", "num_rejected", "num_failed", "prompt_tokens",
            "cached_tokens", "completion_tokens", "wall_s")


def merge(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's slice reports → one: counts summed, ``ttft_mean_s`` weighted
    by requests served, ``tbt_mean_s`` by completion tokens, hit ratios recomputed,
    ``cluster_cpu_s`` summed per process; percentiles are not merged (left out)."""
    out: dict[str, Any] = {k: sum(s.get(k) or 0 for s in slices) for k in SUM_KEYS}
    served, toks = out["num_served"], out["completion_tokens"]
    out["ttft_mean_s"] = (sum((s.get("ttft_mean_s") or 0) * (s.get("num_served") or 0)
                              for s in slices) / served) if served else None
    out["tbt_mean_s"] = (sum((s.get("tbt_mean_s") or 0) * (s.get("completion_tokens") or 0)
                             for s in slices) / toks) if toks else None
    out["token_hit_ratio"] = (out["cached_tokens"] / out["prompt_tokens"]
                              if out["prompt_tokens"] else None)
    cpu: dict[str, float] = {}
    for s in slices:
        for proc, v in s["cluster_cpu_s"].items():
            if proc != "total":
                cpu[proc] = round(cpu.get(proc, 0.0) + v, 2)
    out["cluster_cpu_s"] = {"total": round(sum(cpu.values()), 2), **cpu}
    out["slice_cpu_s"] = [s["cluster_cpu_s"]["total"] for s in slices]
    return out


def run_paired(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``{"results": {name: merged report}, "paired": {...}}``; ``paired`` has the slice
    bounds and, with two or more configurations, the CPU ratio of the first to each other
    one: over the whole trace (``ratio``) and per slice (``slice_ratios`` with their
    median and quartiles). Raises ``CommandError`` when a cluster does not start or a
    slice's replay fails."""
    from pymooncake.cli.main import CommandError

    k = args.paired
    bounds = [args.limit * i // k for i in range(k + 1)]
    slices: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
    with ExitStack() as stack:
        clusters = {}
        for n in names:
            c = LocalCluster(cluster_spec(n, args))
            stack.callback(c.stop)
            try:
                c.start()
            except (RuntimeError, TimeoutError) as e:
                raise CommandError(f"{n}: cluster did not start: {e}") from None
            clusters[n] = c
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            for n in (names if i % 2 == 0 else names[::-1]):
                c = clusters[n]
                cpu0 = c.cpu_seconds()
                r = subprocess.run(replay_argv(c.url, args, skip=lo, limit=hi),
                                   capture_output=True, text=True, timeout=1800, env=env)
                cpu1 = c.cpu_seconds()
                if r.returncode != 0:
                    raise CommandError(f"replay of requests {lo}-{hi - 1} against {n} "
                                       f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
                res = json.loads(r.stdout)
                cpu = {p: round(cpu1[p] - cpu0[p], 2) for p in cpu1 if p in cpu0}
                res["cluster_cpu_s"] = {"total": round(sum(cpu.values()), 2), **cpu}
                slices[n].append(res)
    results = {n: merge(s) for n, s in slices.items()}
    paired: dict[str, Any] = {"slices": k, "bounds": bounds}
    first = names[0]
    for other in names[1:]:
        per = [a / b for a, b in zip(results[first]["slice_cpu_s"],
                                     results[other]["slice_cpu_s"], strict=True) if b > 0]
        s = spread(per) if per else {}
        paired[f"{first}/{other}"] = {
            "ratio": (results[first]["cluster_cpu_s"]["total"]
                      / results[other]["cluster_cpu_s"]["total"]),
            "slice_ratios": per, "slice_median": s.get("median"),
            "slice_q1": s.get("q1"), "slice_q3": s.get("q3")}
    return {"results": results, "paired": paired}
