"""``pymooncake sim ...``: trace-replay simulator (DESIGN.md §8) and ``pymooncake bench sim``.

Heavy imports (numpy, matplotlib, rich, the simulator) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit


def _default_traces_dir() -> Path:
    """``../shared/traces`` beside the checkout (or beside the working directory)."""
    for base in (Path(__file__).resolve().parents[3].parent, Path.cwd().resolve().parent):
        if (base / "shared" / "traces").is_dir():
            return base / "shared" / "traces"
    return Path("../shared/traces")


DEFAULT_TRACES_DIR = _default_traces_dir()
SCENARIOS = ("colocated", "pd", "pd-local", "pd-global")
SCHEDULERS = ("random", "round-robin", "load", "local-cache", "global-cache")


def _errors() -> tuple[type[BaseException], ...]:
    from pymooncake.sim.cost_model import CostModelError
    from pymooncake.workload.trace import TraceError
    return (CostModelError, TraceError, ValueError, OSError)


GPUS = ("A800", "H800", "H100", "H200")
MODELS = ("llama3-70b", "llama2-70b")


def _int_tokens(text: str) -> int:
    """argparse type: an integral count, also written as 1e6 or 3_000_000."""
    try:
        v = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v != int(v):
        raise argparse.ArgumentTypeError(f"must be an integral number of tokens, got {text!r}")
    return int(v)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (defaults: the paper's setting)")
    g.add_argument("--scenario", choices=SCENARIOS, default="pd-global",
                   help="colocated (vLLM-like), pd (no cache), pd-local, pd-global "
                        "(default %(default)s)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default=None,
                   help="prefill policy from conductor.policy (default global-cache; load "
                        "for --scenario pd, which has no cache for local-cache/global-cache "
                        "to use; with pd-local and colocated global-cache equals local-cache)")
    g.add_argument("--prefill", type=int, default=8, metavar="N",
                   help="prefill nodes (colocated: nodes) (default %(default)s)")
    g.add_argument("--decode", type=int, default=8, metavar="M",
                   help="decode nodes; ignored for colocated (default %(default)s)")
    g.add_argument("--model", default="llama3-70b",
                   help="llama3-70b, llama2-70b or a path to a HF config.json (default "
                        "%(default)s)")
    g.add_argument("--gpu", default="A800",
                   help="A800, H800, H100, H200; a node = 8 GPUs (default %(default)s)")
    g.add_argument("--calibration", default=None, metavar="FILE",
                   help="CPU calibration (sim calibrate-cpu): measured costs replace "
                        "--model/--gpu and --bandwidth-gbps; a node = one core")
    g.add_argument("--cache-capacity-tokens", type=_int_tokens, default=None, metavar="C",
                   help="KV cache per node in tokens (default: 3000000 of DRAM per prefill "
                        "node for pd-local/pd-global; for colocated half the HBM KV space "
                        "left after the weights, deducted from decode KV; not allowed "
                        "for pd)")
    g.add_argument("--output-length", type=int, default=None, metavar="L",
                   help="override every request's output length in tokens, >= 1 "
                        "(default: the trace's)")
    g.add_argument("--ttft-slo-s", type=float, default=30.0, metavar="S",
                   help="TTFT objective in seconds (default %(default)s)")
    g.add_argument("--tbt-slo-s", type=float, default=0.1, metavar="S",
                   help="TBT objective in seconds: mean of a request's longest 10%% of "
                        "token intervals (default %(default)s)")
    g.add_argument("--early-rejection", action=argparse.BooleanOptionalAction, default=False,
                   help="reject requests predicted to miss an SLO (default off)")
    g.add_argument("--bandwidth-gbps", type=float, default=696.0,
                   help="inter-node KV bandwidth in Gbps (default %(default)s = 87 GB/s)")
    g.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="colocated: interleave prefill chunks with decode steps "
                        "(default on)")
    g.add_argument("--chunk-size-tokens", type=int, default=4096, metavar="T",
                   help="colocated chunked prefill: tokens per chunk (default %(default)s)")
    g.add_argument("--max-batch-size", type=int, default=256, metavar="B",
                   help="largest continuous batch of a decode node (default %(default)s)")
    g.add_argument("--balancing-threshold", type=float, default=1.0,
                   help="Algorithm 1's kvcache_balancing_threshold, >= 0 "
                        "(default %(default)s)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the random scheduler (default %(default)s)")
    _add_trace_flags(p, scale=True)


def _add_trace_flags(p: argparse.ArgumentParser, *, scale: bool) -> None:
    t = p.add_argument_group("trace")
    if scale:
        t.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                       help="speed arrivals up by X, a finite number > 0 (2 = twice the "
                            "request rate; default %(default)s)")
    t.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N requests, N >= 1 (default: all)")
    t.add_argument("--skip-invalid", action="store_true",
                   help="drop malformed trace lines instead of failing")


def _usage(msg: str) -> None:
    from pymooncake.cli.main import UsageError
    raise UsageError(msg)


def _need(flag: str, v: float | None, what: str, ok: bool) -> None:
    if not ok:
        _usage(f"{flag} must be {what}, got {v:g}" if isinstance(v, float)
               else f"{flag} must be {what}, got {v}")


def _need_finite(flag: str, v: float, lo: float, *, strict: bool = True) -> None:
    ok = math.isfinite(v) and (v > lo if strict else v >= lo)
    _need(flag, v, f"a finite number {'>' if strict else '>='} {lo:g}", ok)


def _need_int(flag: str, v: int | None, lo: int) -> None:
    if v is not None:
        _need(flag, v, f"an integer >= {lo}", v >= lo)


def _need_out_path(flag: str, path: str | Path, suffix: str | None = None) -> None:
    p = Path(path)
    if suffix is not None and p.suffix.lower() != suffix:
        _usage(f"{flag} must name a {suffix} file, got {str(path)!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        _usage(f"{flag} {path}: directory {parent} does not exist")


def _check_trace_args(args: argparse.Namespace) -> None:
    _need_int("--limit", getattr(args, "limit", None), 1)
    if hasattr(args, "time_scale"):
        _need_finite("--time-scale", args.time_scale, 0)


def _check_model_gpu(args: argparse.Namespace) -> None:
    if args.model.lower() not in MODELS and not (args.model.endswith(".json")
                                                  or Path(args.model).is_dir()):
        _usage(f"--model: unknown model {args.model!r}; use one of {', '.join(MODELS)} or a "
               "path to a Hugging Face config.json")
    if args.gpu.upper() not in GPUS:
        _usage(f"--gpu: unknown GPU {args.gpu!r}; use one of {', '.join(GPUS)}")


def _check_cluster_args(args: argparse.Namespace) -> None:
    """Every flag's value, before anything is read or run (exit 2 naming the flag)."""
    _check_model_gpu(args)
    _need_int("--prefill", args.prefill, 1)
    if args.scenario != "colocated":
        _need_int("--decode", args.decode, 1)
    _need_int("--cache-capacity-tokens", args.cache_capacity_tokens, 0)
    _need_int("--output-length", args.output_length, 1)
    _need_finite("--ttft-slo-s", args.ttft_slo_s, 0)
    _need_finite("--tbt-slo-s", args.tbt_slo_s, 0)
    _need_finite("--bandwidth-gbps", args.bandwidth_gbps, 0)
    _need_int("--chunk-size-tokens", args.chunk_size_tokens, 1)
    _need_int("--max-batch-size", args.max_batch_size, 1)
    _need_finite("--balancing-threshold", args.balancing_threshold, 0, strict=False)
    if args.scenario == "pd":
        if args.scheduler in ("local-cache", "global-cache"):
            _usage(f"--scheduler {args.scheduler} needs a cache and --scenario pd has none; "
                   "use --scheduler load/round-robin/random or --scenario pd-local/pd-global")
        if args.cache_capacity_tokens:
            _usage("--cache-capacity-tokens: --scenario pd has no cross-request cache; use "
                   "--scenario pd-local or pd-global")
    _check_trace_args(args)


def _scheduler(args: argparse.Namespace) -> str:
    if args.scheduler is not None:
        return args.scheduler
    return "load" if args.scenario == "pd" else "global-cache"


def _config(args: argparse.Namespace, **over: Any):  # noqa: ANN202
    from pymooncake.sim.config import SimConfig
    kw = dict(scenario=args.scenario, scheduler=_scheduler(args), num_prefill=args.prefill,
              num_decode=args.decode, model=args.model, gpu=args.gpu,
              calibration=getattr(args, "calibration", None),
              cache_capacity_tokens=args.cache_capacity_tokens, output_length=args.output_length,
              ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_s,
              early_rejection=args.early_rejection, network_bandwidth_gbps=args.bandwidth_gbps,
              chunked_prefill=args.chunked_prefill, chunk_size_tokens=args.chunk_size_tokens,
              max_batch_size=args.max_batch_size,
              kvcache_balancing_threshold=args.balancing_threshold, seed=args.seed)
    kw.update(over)
    cfg = SimConfig(**kw)
    from pymooncake.sim.runner import build_cost_model
    cm = build_cost_model(cfg)  # a bad model config.json fails here, before the trace is read
    if cfg.scenario == "colocated":
        try:
            cfg.resolve_cache_tokens(cm.kv_capacity_tokens)
        except ValueError as e:
            _usage(f"--cache-capacity-tokens: {e}")
    return cfg


def _trace(args: argparse.Namespace):  # noqa: ANN202
    from pymooncake.workload import load_trace, scale_arrivals, take_first
    t = load_trace(args.trace, skip_invalid=getattr(args, "skip_invalid", False))
    if getattr(args, "limit", None) is not None:
        t = take_first(t, args.limit)
    if getattr(args, "time_scale", 1.0) != 1.0:
        t = scale_arrivals(t, args.time_scale)
    if not t.requests:
        raise ValueError(f"{args.trace}: the trace has no requests")
    return t


def _fail(e: BaseException) -> None:
    from pymooncake.cli.main import CommandError
    raise CommandError(str(e)) from None


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
    _check_cluster_args(args)
    if args.csv:
        _need_out_path("--csv", args.csv)
    try:
        cfg = _config(args)
        trace = _trace(args)
        from pymooncake.sim.report import summarize, write_csv
        from pymooncake.sim.runner import simulate
        res = simulate(trace, cfg)
        if args.csv:
            write_csv(res.requests, args.csv)
    except _errors() as e:
        _fail(e)
    s = summarize(res)
    if not args.json:
        s = {k: v for k, v in s.items() if k != "hot_key_replicas"}
    emit(s, args.json, lambda d: _table(f"pymooncake sim run {args.trace}",
                                        [(k, _fmt(v)) for k, v in d.items()]))
    return 0


def _cmd_capacity(args: argparse.Namespace) -> int:
    _check_trace_args(args)
    for c in args.capacities or ():
        _need_int("--capacities", c, 0)
    try:
        from pymooncake.sim.capacity import DEFAULT_CAPACITIES_TOKENS, capacity_curve
        caps = args.capacities or DEFAULT_CAPACITIES_TOKENS
        c = capacity_curve(_trace(args), caps)
    except _errors() as e:
        _fail(e)
    out = {"capacities_tokens": list(c.capacities_tokens), "hit_ratio": list(c.hit_ratio),
           "max_hit_ratio": c.max_hit_ratio}
    emit(out, args.json, lambda d: _table(
        f"token-weighted hit ratio vs LRU capacity ({args.trace})",
        [(f"{cap:,} tokens", f"{h:.4f}") for cap, h in zip(d["capacities_tokens"],
                                                             d["hit_ratio"], strict=True)]
        + [("infinite (max)", f"{d['max_hit_ratio']:.4f}")]))
    return 0


def _check_sweep_values(args: argparse.Namespace) -> None:
    total = args.prefill + args.decode
    for v in args.values:
        if args.over == "rate":
            _need_finite("--values (rate factors)", v, 0)
        elif args.over == "bandwidth":
            _need_finite("--values (Gbps)", v, 0)
        elif args.over == "capacity":
            _need("--values (tokens)", v, "an integral number >= 0",
                  math.isfinite(v) and v >= 0 and v == int(v))
            if args.scenario == "pd":
                _usage("--over capacity: --scenario pd has no cache; use pd-local or "
                       "pd-global")
        else:
            _need("--values (prefill nodes)", v,
                  f"an integer in [1, {total - 1}] (prefill nodes out of --prefill + "
                  f"--decode = {total})",
                  math.isfinite(v) and v == int(v) and 1 <= v < total)
    _need("--target-attainment", args.target_attainment, "a number in [0, 1]",
          0.0 <= args.target_attainment <= 1.0)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from rich.progress import Progress
    _check_cluster_args(args)
    _check_sweep_values(args)
    try:
        cfg = _config(args)
        if args.over == "capacity" and cfg.scenario == "colocated":
            from pymooncake.sim.runner import build_cost_model
            hbm_kv = build_cost_model(cfg).kv_capacity_tokens
            for v in args.values:
                if v >= hbm_kv:
                    _usage(f"--values (tokens): a colocated prefix cache lives in HBM; {v:g} "
                           f"tokens leave no KV space (the node holds {hbm_kv} KV tokens)")
        trace = _trace(args)
        from pymooncake.sim.sweep import best_point, sweep
        with Progress(transient=True, disable=args.json or not sys.stderr.isatty()) as prog:
            task = prog.add_task(f"sweep {args.over}", total=len(args.values))
            pts = sweep(trace, cfg, args.over, args.values,
                        lambda i, n: prog.update(task, completed=i))
    except _errors() as e:
        _fail(e)
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
    _check_cluster_args(args)
    _need_out_path("--out", args.out, ".png")
    try:
        trace = _trace(args)
        from pymooncake.sim.plot import plot
        path = plot(trace, args.kind, args.out, base=_config(args))
    except _errors() as e:
        _fail(e)
    emit({"kind": args.kind, "png": str(path)}, args.json, lambda d: f"wrote {d['png']}")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    _need_out_path("--out", args.out)
    if not Path(args.traces_dir).is_dir():
        _usage(f"--traces-dir {args.traces_dir}: no such directory")
    try:
        from pymooncake.sim.reproduce import reproduce
        say = None if args.json else (lambda s: sys.stderr.write(f"running {s}...\n"))
        results, md = reproduce(args.traces_dir, say)
        Path(args.out).write_text(md)
    except _errors() as e:
        _fail(e)
    emit({"out": str(args.out), **results}, args.json, lambda d: f"wrote {d['out']}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    _check_model_gpu(args)
    if args.gpu.upper() != "A800" or args.model.lower() != "llama3-70b":
        _usage("calibrate compares with the paper's Figure 14a, measured with LLaMA3-70B on "
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
    except _errors() as e:
        _fail(e)
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
    _add_cluster_flags(p)
    p.add_argument("--csv", metavar="PATH", help="write per-request records here")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_run)

    p = sim.add_parser("capacity-curve", help="hit ratio vs LRU capacity (paper Figure 9)",
                       description="Token-weighted hit ratio of one global LRU cache for "
                                   "capacities from 10k to 1G tokens, and the infinite maximum.")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--capacities", type=_int_tokens, nargs="+", metavar="TOKENS",
                   help="capacities in tokens, >= 0; 1e6-style integral numbers accepted "
                        "(default: the paper's vertices + 3M, 30M)")
    _add_trace_flags(p, scale=False)
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
    _add_cluster_flags(p)
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
    _add_cluster_flags(p)
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
    _need_int("--repeat", args.repeat, 1)
    if args.dynamo_python is not None and shutil.which(args.dynamo_python) is None:
        _usage(f"--dynamo-python: interpreter {args.dynamo_python} not found (or not "
               "executable)")
    from pymooncake.sim.bench import run_bench
    try:
        out = run_bench(args.trace, with_dynamo=not args.no_dynamo, repeat=args.repeat,
                        dynamo_python=args.dynamo_python)
    except _errors() as e:
        _fail(e)
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
