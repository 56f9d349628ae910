"""``pymooncake bench serving``: live trace replay against local P/D and colocated clusters.

Each configuration (``BENCH_CONFIGS``) is started as a real ``LocalCluster`` (the tiny
model unless ``--model``), waited for until ``/health`` is 200, replayed with
``pymooncake replay``, and stopped. docs/serving.md, "Benchmark"; figures in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pymooncake.cli.cluster import PARENT_ENV, ClusterSpec, LocalCluster
from pymooncake.cli.common import add_json_flag

BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "global-cache": {"policy": "global-cache"},
    "random": {"policy": "random"},
    "colocated-no-cache": {"colocated": True, "prefix_cache": False},
    "colocated-cache": {"colocated": True},
}
"""The issue's comparison: P/D + global Store + cache-aware placement (Algorithm 1), P/D with
random placement (local caches only, the paper's Figure 5 baseline), and colocated workers
without a prefix cache; ``colocated-cache`` (colocated workers with their local prefix
caches) is the CPU reference of issue 16 (P/D CPU seconds per request <= 1.05x it).
Every configuration runs the same number of engine processes."""


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench serving``."""
    b = bench_subparsers.add_parser(
        "serving", help="live trace replay against P/D and colocated clusters",
        description="Start each configuration as a real local cluster, replay the first "
                    "--limit requests of the bundled conversation trace through the OpenAI "
                    "API (pymooncake replay), and compare TTFT/TBT, hits and rejections.")
    b.add_argument("--configs", default=",".join(BENCH_CONFIGS),
                   help=f"comma-separated subset of {', '.join(BENCH_CONFIGS)}")
    b.add_argument("--limit", type=int, default=300, help="trace requests replayed")
    b.add_argument("--repeats", type=int, default=1,
                   help="replay each configuration this many times, interleaved; numbers "
                        "are means over the repeats, with per-repeat values listed")
    b.add_argument("--paired", type=int, default=0, metavar="K",
                   help="start every configuration's cluster at once and replay the trace "
                        "in K slices that they take in turn (A B, B A, ...), so a slow "
                        "minute of a shared machine hits them alike; CPU ratios of the "
                        "first configuration to the others, whole and per slice; 0 = one "
                        "whole replay each (default)")
    b.add_argument("--time-scale", type=float, default=1.0, help="arrival speed-up")
    b.add_argument("--length-scale", type=int, default=32, help="divide lengths by this")
    b.add_argument("--prefill", type=int, default=2, help="prefill workers (P/D configs)")
    b.add_argument("--decode", type=int, default=1, help="decode workers (P/D configs)")
    b.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT objective (s)")
    b.add_argument("--tbt-slo", type=float, default=0.5,
                   help="TBT objective (s; default %(default)s)")
    b.add_argument("--decode-step-interval-s", type=float, default=0.0, metavar="S",
                   help="P/D configs: the decode workers start a step at most every S "
                        "seconds while requests decode (pymooncake decode "
                        "--decode-step-interval-s); in [0, 10] and below --tbt-slo; 0 = off "
                        "(default)")
    b.add_argument("--global-segment-size", type=int, default=512 << 20,
                   help="DRAM each prefill worker gives the Store (bytes)")
    b.add_argument("--model", default="tiny",
                   help="model of every cluster (default tiny: the figures in "
                        "docs/benchmarks.md are the tiny model's)")
    add_json_flag(b)
    b.set_defaults(handler=_cmd_bench_serving)


def _cmd_bench_serving(args: argparse.Namespace) -> int:
    import os
    import platform

    from pymooncake.cli.common import emit
    from pymooncake.cli.main import UsageError
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    from pymooncake.engine.worker.config import MAX_DECODE_STEP_INTERVAL_S
    if not 0 <= args.decode_step_interval_s <= MAX_DECODE_STEP_INTERVAL_S:
        raise UsageError(f"--decode-step-interval-s must be in [0, {MAX_DECODE_STEP_INTERVAL_S:g}] "
                         f"seconds, got {args.decode_step_interval_s}")
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in BENCH_CONFIGS]
    if bad or not names:
        raise UsageError(f"--configs: unknown {bad}; choose from {', '.join(BENCH_CONFIGS)}")
    if args.decode_step_interval_s and all(BENCH_CONFIGS[n].get("colocated") for n in names):
        raise UsageError("--decode-step-interval-s paces the P/D configs' decode workers; "
                         f"--configs {args.configs} has none")
    if args.decode_step_interval_s >= args.tbt_slo:
        raise UsageError(f"--decode-step-interval-s ({args.decode_step_interval_s} s) must "
                         f"be below --tbt-slo ({args.tbt_slo} s)")
    if not 0 <= args.paired <= args.limit:
        raise UsageError(f"--paired must be in [0, --limit], got {args.paired}")
    if args.paired and args.repeats > 1:
        raise UsageError("--paired takes every configuration in turn already; "
                         "use --repeats 1 with it")
    extra: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    if args.paired:
        from pymooncake.cli.bench_serving_paired import run_paired
        got = run_paired(names, args)
        extra["paired"] = got["paired"]
        runs = {n: [r] for n, r in got["results"].items()}
    for rep in range(0 if args.paired else args.repeats):
        # interleaved, each repeat starting one configuration later: a slow minute on the
        # shared machine does not always land on the same configuration
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(_bench_one(name, args))
    results = {n: _aggregate(rs) for n, rs in runs.items()}
    doc = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
           "limit": args.limit, "time_scale": args.time_scale,
           "length_scale": args.length_scale, "prefill": args.prefill, "decode": args.decode,
           "decode_step_interval_s": args.decode_step_interval_s,
           "repeats": args.repeats, "results": results, **extra}

    def human(d: dict[str, Any]) -> str:
        keys = ("num_requests", "num_rejected", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
                "tbt_mean_s", "tbt_p99_s", "slo_attainment", "request_hit_ratio",
                "token_hit_ratio")
        lines = [f"{'config':<20}" + "".join(f"{k:>18}" for k in keys)]
        for n, res in d["results"].items():
            cells = []
            for k in keys:
                v = res.get(k)
                cells.append(f"{v:>18.4f}" if isinstance(v, float) else f"{v!s:>18}")
            lines.append(f"{n:<20}" + "".join(cells))
        for pair, v in d.get("paired", {}).items():
            if isinstance(v, dict):
                lines.append(f"cluster CPU {pair}: {v['ratio']:.3f} over the trace; per slice "
                             f"median {v['slice_median']:.3f} [{v['slice_q1']:.3f}-"
                             f"{v['slice_q3']:.3f}] ({d['paired']['slices']} slices in turn)")
        if d["repeats"] > 1:
            lines.append("mean TTFT (s) of each repeat, in run order:")
            for n, res in d["results"].items():
                lines.append(f"  {n:<20}" + " ".join(
                    f"{v:.4f}" for v in res["per_repeat"]["ttft_mean_s"]))
        return "\n".join(lines)

    emit(doc, args.json, human)
    return 0


def cluster_spec(name: str, args: argparse.Namespace) -> ClusterSpec:
    """The local cluster of configuration ``name`` (``BENCH_CONFIGS``): every configuration
    runs ``--prefill`` + ``--decode`` engine processes."""
    extra = BENCH_CONFIGS[name]
    n_engines = args.prefill + args.decode
    return ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                       global_segment_size=args.global_segment_size,
                       num_prefill=n_engines if extra.get("colocated") else args.prefill,
                       num_decode=0 if extra.get("colocated") else args.decode,
                       ttft_slo_s=args.ttft_slo * 10, tbt_slo_s=args.tbt_slo * 10,
                       model=args.model, **extra, decode_step_interval_s=0.0
                       if extra.get("colocated") else args.decode_step_interval_s)


def replay_argv(url: str, args: argparse.Namespace, skip: int = 0,
                limit: int | None = None) -> list[str]:
    """``pymooncake replay`` of the first ``limit`` (default ``--limit``) trace requests
    less the first ``skip``, against ``url``, with the bench's scales and SLOs."""
    return [sys.executable, "-m", "pymooncake", "replay", "--url", url,
            "--limit", str(limit or args.limit), "--skip", str(skip),
            "--time-scale", str(args.time_scale), "--length-scale", str(args.length_scale),
            "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo), "--json"]


def _bench_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: a fresh local cluster, one replay, the replay's JSON report plus
    the CPU seconds each cluster process and the replay client used during it."""
    import os
    import resource
    import subprocess

    from pymooncake.cli.main import CommandError
    cluster = LocalCluster(cluster_spec(name, args))
    try:
        cluster.start()
        argv = replay_argv(cluster.url, args)
        cpu0, ru0 = cluster.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
        # the replay dies with this process (SIGTERM, ^C) as the cluster's children do
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
        cpu1, ru1 = cluster.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            raise CommandError(f"replay against {name} failed: "
                               f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        res: dict[str, Any] = json.loads(r.stdout)   # with replay's per-stage means
        cpu = {n: round(cpu1[n] - cpu0[n], 2) for n in cpu1 if n in cpu0}
        res["cluster_cpu_s"] = {"total": round(sum(cpu.values()), 2), **cpu}
        res["replay_client_cpu_s"] = round(
            ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2)
        return res
    except (RuntimeError, TimeoutError) as e:
        raise CommandError(f"{name}: cluster did not start: {e}") from None
    finally:
        cluster.stop()


REPEAT_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s",
               "slo_attainment", "token_hit_ratio")
"""Per-repeat values kept in ``bench serving``'s ``per_repeat`` lists."""


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats → one report. A single run is returned as it is. With
    several, every number (also nested ones: stage means, CPU seconds) is the mean over the
    repeats — for ``ttft_mean_s`` that is the mean over all requests of all repeats when
    every repeat served the same number (each replays the same requests); percentiles are
    the mean of the per-repeat
    percentiles — and ``per_repeat`` lists ``REPEAT_KEYS`` of each repeat in run order."""
    if len(runs) == 1:
        return runs[0]

    def mean(vals: list[Any]) -> Any:
        if all(isinstance(v, dict) for v in vals):
            keys = [k for k in vals[0] if all(k in v for v in vals)]
            return {k: mean([v[k] for v in vals]) for k in keys}
        if all(v == vals[0] for v in vals):
            return vals[0]               # counts such as num_requests stay ints
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return sum(vals) / len(vals)
        return vals[-1]

    out: dict[str, Any] = mean(runs)
    out["repeats"] = len(runs)
    out["per_repeat"] = {k: [r.get(k) for r in runs] for k in REPEAT_KEYS}
    return out
