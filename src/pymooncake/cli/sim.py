"""``pymooncake sim ...``: trace-replay simulator (DESIGN.md §8) and ``pymooncake bench sim``.

The sub-commands (run, capacity-curve, sweep, plot, reproduce, calibrate, bench sim), their
parsers and their tables; the flags and their checks are in ``cli.sim_args``. Heavy imports
(numpy, matplotlib, rich, the simulator) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit
from pymooncake.cli.sim_args import (
    DEFAULT_TRACES_DIR,
    add_cluster_flags,
    add_trace_flags,
    check_cluster_args,
    check_model_gpu,
    check_sweep_values,
    check_trace_args,
    fail,
    int_tokens,
    need_int,
    need_out_path,
    sim_config,
    sim_errors,
    sim_trace,
    usage,
)


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table
    tab = Table(title=title)
    tab.add_column("metric")
    tab.add_column("value", justify="right")
    for k, v in rows:
        tab.add_row(k, v)
    buf = StringIO()
    Console(file=buf, width=100, force_terminal=False).print(tab)
    return buf.getvalue()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.4g}"
    if v is None:
        return "–"
    return str(v)


def _cmd_run(args: argparse.Namespace) -> int:
    check_cluster_args(args)
    if args.csv:
        need_out_path("--csv", args.csv)
    try:
        cfg = sim_config(args)
        trace = sim_trace(args)
        from pymooncake.sim.report import summarize, write_csv
        from pymooncake.sim.runner import simulate
        res = simulate(trace, cfg)
        if args.csv:
            write_csv(res.requests, args.csv)
    except sim_errors() as e:
        fail(e)
    s = summarize(res)
    if not args.json:
        s = {k: v for k, v in s.items() if k != "hot_key_replicas"}
    emit(s, args.json, lambda d: _table(f"pymooncake sim run {args.trace}",
                                        [(k, _fmt(v)) for k, v in d.items()]))
    return 0


def _cmd_capacity(args: argparse.Namespace) -> int:
    check_trace_args(args)
    for c in args.capacities or ():
        need_int("--capacities", c, 0)
    try:
        from pymooncake.sim.capacity import DEFAULT_CAPACITIES_TOKENS, capacity_curve
        caps = args.capacities or DEFAULT_CAPACITIES_TOKENS
        c = capacity_curve(sim_trace(args), caps)
    except sim_errors() as e:
        fail(e)
    out = {"capacities_tokens": list(c.capacities_tokens), "hit_ratio": list(c.hit_ratio),
           "max_hit_ratio": c.max_hit_ratio}
    emit(out, args.json, lambda d: _table(
        f"token-weighted hit ratio vs LRU capacity ({args.trace})",
        [(f"{cap:,} tokens", f"{h:.4f}") for cap, h in zip(d["capacities_tokens"],
                                                             d["hit_ratio"], strict=True)]
        + [("infinite (max)", f"{d['max_hit_ratio']:.4f}")]))
    return 0



def _cmd_sweep(args: argparse.Namespace) -> int:
    from rich.progress import Progress
    check_cluster_args(args)
    check_sweep_values(args)
    try:
        cfg = sim_config(args)
        if args.over == "capacity" and cfg.scenario == "colocated":
            from pymooncake.sim.runner import build_cost_model
            hbm_kv = build_cost_model(cfg).kv_capacity_tokens
            for v in args.values:
                if v >= hbm_kv:
                    usage(f"--values (tokens): a colocated prefix cache lives in HBM; {v:g} "
                           f"tokens leave no KV space (the node holds {hbm_kv} KV tokens)")
        trace = sim_trace(args)
        from pymooncake.sim.sweep import best_point, sweep
        with Progress(transient=True, disable=args.json or not sys.stderr.isatty()) as prog:
            task = prog.add_task(f"sweep {args.over}", total=len(args.values))
            pts = sweep(trace, cfg, args.over, args.values,
                        lambda i, n: prog.update(task, completed=i))
    except sim_errors() as e:
        fail(e)
    best = best_point(pts, args.over, args.target_attainment)
    keys = ("slo_attainment", "ttft_mean_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s",
            "token_hit_ratio", "num_rejected")
    out = {"over": args.over, "target_attainment": args.target_attainment,
           "points": [{"value": p.value, "num_prefill": p.config.num_prefill,
                       "num_decode": p.config.num_decode, "goodput_per_s": p.goodput_per_s,
                       **{k: p.summary[k] for k in keys}} for p in pts],
           "best_value": best.value if best else None}

    def human(d: dict[str, Any]) -> str:
        rows = [(f"{args.over}={p['value']:g} ({p['num_prefill']}P{p['num_decode']}D)",
                 f"SLO {p['slo_attainment']:.3f}  TTFT {p['ttft_mean_s']:.2f}s  "
                 f"TBT {p['tbt_mean_s'] * 1000:.1f}ms  goodput {p['goodput_per_s']:.3f}/s")
                for p in d["points"]]
        rows.append(("best", _fmt(d["best_value"])))
        return _table(f"sweep over {args.over}", rows)
    emit(out, args.json, human)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    check_cluster_args(args)
    need_out_path("--out", args.out, ".png")
    try:
        trace = sim_trace(args)
        from pymooncake.sim.plot import plot
        path = plot(trace, args.kind, args.out, base=sim_config(args))
    except sim_errors() as e:
        fail(e)
    emit({"kind": args.kind, "png": str(path)}, args.json, lambda d: f"wrote {d['png']}")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    need_out_path("--out", args.out)
    if not Path(args.traces_dir).is_dir():
        usage(f"--traces-dir {args.traces_dir}: no such directory")
    try:
        from pymooncake.sim.reproduce import reproduce
        say = None if args.json else (lambda s: sys.stderr.write(f"running {s}...\n"))
        results, md = reproduce(args.traces_dir, say)
        Path(args.out).write_text(md)
    except sim_errors() as e:
        fail(e)
    emit({"out": str(args.out), **results}, args.json, lambda d: f"wrote {d['out']}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    check_model_gpu(args)
    if args.gpu.upper() != "A800" or args.model.lower() != "llama3-70b":
        usage("calibrate compares with the paper's Figure 14a, measured with LLaMA3-70B on "
               f"8xA800: use --model llama3-70b --gpu A800 (got --model {args.model} "
               f"--gpu {args.gpu}); other GPUs reuse the A800 efficiencies unchecked")
    try:
        from pymooncake.sim.cost_model import (
            CostModel,
            calibration_table,
            resolve_gpu,
            resolve_model,
        )
        rows = calibration_table(CostModel(resolve_model(args.model), resolve_gpu(args.gpu)))
    except sim_errors() as e:
        fail(e)
    emit({"rows": rows}, args.json, lambda d: _table(
        "model vs paper Figure 14a", [
            (f"{r['prompt_tokens']} tokens", f"prefill {r['prefill_model_s']:.3f}s "
             f"({100 * r['prefill_error']:+.1f}%)  decode128 {r['decode128_model_s']:.3f}s "
             f"({100 * r['decode128_error']:+.1f}%)") for r in d["rows"]]))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake sim``."""
    sim = add_group(subparsers, "sim", "trace-replay simulator sharing the Conductor's policy")

    p = sim.add_parser("run", help="replay a trace on a modelled cluster",
                       description="Replay a Mooncake trace on a modelled cluster and print the "
                                   "summary (TTFT/TBT, SLO attainment, hit ratios, ...).")
    p.add_argument("trace", metavar="TRACE", help="Mooncake JSONL trace (.jsonl or .jsonl.gz)")
    add_cluster_flags(p)
    p.add_argument("--csv", metavar="PATH", help="write per-request records here")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_run)

    p = sim.add_parser("capacity-curve", help="hit ratio vs LRU capacity (paper Figure 9)",
                       description="Token-weighted hit ratio of one global LRU cache for "
                                   "capacities from 10k to 1G tokens, and the infinite maximum.")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--capacities", type=int_tokens, nargs="+", metavar="TOKENS",
                   help="capacities in tokens, >= 0; 1e6-style integral numbers accepted "
                        "(default: the paper's vertices + 3M, 30M)")
    add_trace_flags(p, scale=False)
    add_json_flag(p)
    p.set_defaults(handler=_cmd_capacity)

    p = sim.add_parser("sweep", help="sweep rate, P:D ratio, cache capacity or bandwidth",
                       description="Run the simulator once per value; report SLO attainment "
                                   "and goodput, and the best value (highest rate meeting the "
                                   "target, or the max-goodput P:D split / capacity / "
                                   "bandwidth).")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--over", required=True, choices=("rate", "pd-ratio", "capacity",
                                                     "bandwidth"),
                   help="rate: time-scale factors; pd-ratio: prefill node counts out of "
                        "--prefill + --decode; capacity: tokens per node; bandwidth: Gbps")
    p.add_argument("--values", type=float, nargs="+", required=True,
                   help="rate: factors > 0; pd-ratio: prefill node counts in [1, P+D-1]; "
                        "capacity: tokens >= 0; bandwidth: Gbps > 0")
    p.add_argument("--target-attainment", type=float, default=0.99,
                   help="SLO attainment the rate sweep must keep (default %(default)s)")
    add_cluster_flags(p)
    add_json_flag(p)
    p.set_defaults(handler=_cmd_sweep)

    p = sim.add_parser("plot", help="paper-style figures to PNG (matplotlib)",
                       description="capacity: hit rate vs cache capacity (Fig. 9); schedulers: "
                                   "TTFT by scheduler (Fig. 5); tbt: effective capacity vs TBT "
                                   "threshold (Fig. 1).")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--kind", choices=("capacity", "schedulers", "tbt"), default="capacity")
    p.add_argument("--out", default="sim.png",
                   help="PNG path; its directory must exist (default %(default)s)")
    add_cluster_flags(p)
    add_json_flag(p)
    p.set_defaults(handler=_cmd_plot)

    p = sim.add_parser("reproduce", help="regenerate docs/paper-reproduction.md",
                       description="Run Figures 9, 10, 5 and 1 and the Figure 14 calibration on "
                                   "the public traces and write the comparison with the paper.")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR),
                   help="folder with conversation_trace.jsonl and synthetic_trace.jsonl "
                        "(default %(default)s)")
    p.add_argument("--out", default="docs/paper-reproduction.md",
                   help="Markdown file to write (default %(default)s)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_reproduce)

    p = sim.add_parser("calibrate", help="cost model vs the paper's Figure 14a",
                       description="Prefill and 128-token decode times of the cost model beside "
                                   "the paper's single-request measurements.")
    p.add_argument("--model", default="llama3-70b",
                   help="model of the cost model; only llama3-70b matches Figure 14a "
                        "(default %(default)s)")
    p.add_argument("--gpu", default="A800",
                   help="GPU preset; only A800 matches Figure 14a (default %(default)s)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_calibrate)
    from pymooncake.cli.sim_calibrate import register as register_calibrate_cpu
    register_calibrate_cpu(sim)


def _cmd_bench(args: argparse.Namespace) -> int:
    import shutil
    need_int("--repeat", args.repeat, 1)
    if args.dynamo_python is not None and shutil.which(args.dynamo_python) is None:
        usage(f"--dynamo-python: interpreter {args.dynamo_python} not found (or not "
               "executable)")
    from pymooncake.bench.sim import run_bench
    try:
        out = run_bench(args.trace, with_dynamo=not args.no_dynamo, repeat=args.repeat,
                        dynamo_python=args.dynamo_python)
    except sim_errors() as e:
        fail(e)
    emit(out, args.json, lambda d: json.dumps(d, indent=2))
    return 0


def register_bench(bench: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench sim``."""
    p = bench.add_parser("sim", help="simulator wall time and peak memory vs Dynamo's replay",
                         description="Simulate the conversation trace on 8 prefill + 8 decode "
                                     "nodes with the global store (in a child process) and, "
                                     "when ai-dynamo is installed, Dynamo's offline replay of "
                                     "the same trace; report wall time, peak RSS and ratios.")
    p.add_argument("--trace", default=str(DEFAULT_TRACES_DIR / "conversation_trace.jsonl"))
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per tool, >= 1; medians reported (default %(default)s)")
    p.add_argument("--no-dynamo", action="store_true", help="skip the Dynamo comparison")
    p.add_argument("--dynamo-python", default=None, metavar="PYTHON",
                   help="interpreter with ai-dynamo installed (default: this one or "
                        "$PYMOONCAKE_DYNAMO_PYTHON)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_bench)
