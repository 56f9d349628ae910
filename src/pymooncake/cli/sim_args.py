"""``pymooncake sim`` flags: the cluster and trace argument groups, their checks (exit 2
naming the flag, before anything is read or run) and what they build (``SimConfig``, the
trace, the scheduler default).

Holds ``add_cluster_flags``, ``add_trace_flags``, the ``need_*`` / ``check_*`` validators,
``sim_config``, ``sim_trace``, ``sim_errors`` and ``fail``; the sub-commands that use them
are in ``cli.sim``. Heavy imports (the simulator, the workload) happen inside the functions.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any


def _default_traces_dir() -> Path:
    """``../shared/traces`` beside the checkout (or beside the working directory)."""
    for base in (Path(__file__).resolve().parents[3].parent, Path.cwd().resolve().parent):
        if (base / "shared" / "traces").is_dir():
            return base / "shared" / "traces"
    return Path("../shared/traces")


DEFAULT_TRACES_DIR = _default_traces_dir()
SCENARIOS = ("colocated", "pd", "pd-local", "pd-global")
SCHEDULERS = ("random", "round-robin", "load", "local-cache", "global-cache")


def sim_errors() -> tuple[type[BaseException], ...]:
    from pymooncake.sim.cost_model import CostModelError
    from pymooncake.workload.trace import TraceError
    return (CostModelError, TraceError, ValueError, OSError)


GPUS = ("A800", "H800", "H100", "H200")
MODELS = ("llama3-70b", "llama2-70b")


def int_tokens(text: str) -> int:
    """argparse type: an integral count, also written as 1e6 or 3_000_000."""
    try:
        v = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v != int(v):
        raise argparse.ArgumentTypeError(f"must be an integral number of tokens, got {text!r}")
    return int(v)


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--cpp-groups", type=int, default=0, metavar="G",
                   help="CPP prefill groups added to the prefill pool, --cpp-stages nodes "
                        "each; long prompts go to them where it pays (docs/cpp.md; "
                        "default %(default)s)")
    g.add_argument("--cpp-stages", type=int, default=None,
                   help="nodes per CPP group (default 2; needs --cpp-groups)")
    g.add_argument("--cpp-min-tokens", type=int, default=None, metavar="T",
                   help="uncached tokens below which a prompt never goes to a CPP group "
                        "(default: the measured break-even, 560); a longer one goes there "
                        "only where the cost model predicts a smaller TTFT; needs "
                        "--cpp-groups")
    g.add_argument("--model", default="llama3-70b",
                   help="llama3-70b, llama2-70b or a path to a HF config.json (default "
                        "%(default)s)")
    g.add_argument("--gpu", default="A800",
                   help="A800, H800, H100, H200; a node = 8 GPUs (default %(default)s)")
    g.add_argument("--calibration", default=None, metavar="FILE",
                   help="CPU calibration (sim calibrate-cpu): measured costs replace "
                        "--model/--gpu and --bandwidth-gbps; a node = one core")
    g.add_argument("--cache-capacity-tokens", type=int_tokens, default=None, metavar="C",
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
    add_trace_flags(p, scale=True)


def add_trace_flags(p: argparse.ArgumentParser, *, scale: bool) -> None:
    t = p.add_argument_group("trace")
    if scale:
        t.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                       help="speed arrivals up by X, a finite number > 0 (2 = twice the "
                            "request rate; default %(default)s)")
    t.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N requests, N >= 1 (default: all)")
    t.add_argument("--skip-invalid", action="store_true",
                   help="drop malformed trace lines instead of failing")


def usage(msg: str) -> None:
    from pymooncake.cli.main import UsageError
    raise UsageError(msg)


def need(flag: str, v: float | None, what: str, ok: bool) -> None:
    if not ok:
        usage(f"{flag} must be {what}, got {v:g}" if isinstance(v, float)
               else f"{flag} must be {what}, got {v}")


def need_finite(flag: str, v: float, lo: float, *, strict: bool = True) -> None:
    ok = math.isfinite(v) and (v > lo if strict else v >= lo)
    need(flag, v, f"a finite number {'>' if strict else '>='} {lo:g}", ok)


def need_int(flag: str, v: int | None, lo: int) -> None:
    if v is not None:
        need(flag, v, f"an integer >= {lo}", v >= lo)


def need_out_path(flag: str, path: str | Path, suffix: str | None = None) -> None:
    p = Path(path)
    if suffix is not None and p.suffix.lower() != suffix:
        usage(f"{flag} must name a {suffix} file, got {str(path)!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        usage(f"{flag} {path}: directory {parent} does not exist")


def check_trace_args(args: argparse.Namespace) -> None:
    need_int("--limit", getattr(args, "limit", None), 1)
    if hasattr(args, "time_scale"):
        need_finite("--time-scale", args.time_scale, 0)


def check_model_gpu(args: argparse.Namespace) -> None:
    if args.model.lower() not in MODELS and not (args.model.endswith(".json")
                                                  or Path(args.model).is_dir()):
        usage(f"--model: unknown model {args.model!r}; use one of {', '.join(MODELS)} or a "
               "path to a Hugging Face config.json")
    if args.gpu.upper() not in GPUS:
        usage(f"--gpu: unknown GPU {args.gpu!r}; use one of {', '.join(GPUS)}")


def check_cluster_args(args: argparse.Namespace) -> None:
    """Every flag's value, before anything is read or run (exit 2 naming the flag)."""
    check_model_gpu(args)
    need_int("--prefill", args.prefill, 1)
    if args.scenario != "colocated":
        need_int("--decode", args.decode, 1)
    need_int("--cache-capacity-tokens", args.cache_capacity_tokens, 0)
    need_int("--output-length", args.output_length, 1)
    need_finite("--ttft-slo-s", args.ttft_slo_s, 0)
    need_finite("--tbt-slo-s", args.tbt_slo_s, 0)
    need_finite("--bandwidth-gbps", args.bandwidth_gbps, 0)
    need_int("--chunk-size-tokens", args.chunk_size_tokens, 1)
    need_int("--max-batch-size", args.max_batch_size, 1)
    need_int("--cpp-groups", getattr(args, "cpp_groups", 0), 0)
    if not getattr(args, "cpp_groups", 0):
        for flag in ("--cpp-stages", "--cpp-min-tokens"):
            if getattr(args, flag[2:].replace("-", "_"), None) is not None:
                usage(f"{flag} describes CPP prefill groups: add --cpp-groups G (G >= 1)")
    else:
        if args.cpp_stages is not None:
            need_int("--cpp-stages", args.cpp_stages, 2)
        if args.scenario == "colocated":
            usage("--cpp-groups adds CPP prefill groups to a P/D scenario, not colocated")
        if args.cpp_min_tokens is not None:
            need_int("--cpp-min-tokens", args.cpp_min_tokens, 0)
    need_finite("--balancing-threshold", args.balancing_threshold, 0, strict=False)
    if args.scenario == "pd":
        if args.scheduler in ("local-cache", "global-cache"):
            usage(f"--scheduler {args.scheduler} needs a cache and --scenario pd has none; "
                   "use --scheduler load/round-robin/random or --scenario pd-local/pd-global")
        if args.cache_capacity_tokens:
            usage("--cache-capacity-tokens: --scenario pd has no cross-request cache; use "
                   "--scenario pd-local or pd-global")
    check_trace_args(args)


def scheduler_of(args: argparse.Namespace) -> str:
    if args.scheduler is not None:
        return args.scheduler
    return "load" if args.scenario == "pd" else "global-cache"


def sim_config(args: argparse.Namespace, **over: Any):  # noqa: ANN202
    from pymooncake.sim.config import SimConfig
    kw = dict(scenario=args.scenario, scheduler=scheduler_of(args), num_prefill=args.prefill,
              num_decode=args.decode, model=args.model, gpu=args.gpu,
              calibration=getattr(args, "calibration", None),
              cache_capacity_tokens=args.cache_capacity_tokens, output_length=args.output_length,
              ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_s,
              early_rejection=args.early_rejection, network_bandwidth_gbps=args.bandwidth_gbps,
              chunked_prefill=args.chunked_prefill, chunk_size_tokens=args.chunk_size_tokens,
              max_batch_size=args.max_batch_size,
              kvcache_balancing_threshold=args.balancing_threshold, seed=args.seed,
              cpp_groups=getattr(args, "cpp_groups", 0),
              cpp_stages=getattr(args, "cpp_stages", None) or 2)
    if getattr(args, "cpp_min_tokens", None) is not None:
        kw["cpp_min_tokens"] = args.cpp_min_tokens
    kw.update(over)
    cfg = SimConfig(**kw)
    from pymooncake.sim.runner import build_cost_model
    cm = build_cost_model(cfg)  # a bad model config.json fails here, before the trace is read
    if cfg.scenario == "colocated":
        try:
            cfg.resolve_cache_tokens(cm.kv_capacity_tokens)
        except ValueError as e:
            usage(f"--cache-capacity-tokens: {e}")
    return cfg


def sim_trace(args: argparse.Namespace):  # noqa: ANN202
    from pymooncake.workload import load_trace, scale_arrivals, take_first
    t = load_trace(args.trace, skip_invalid=getattr(args, "skip_invalid", False))
    if getattr(args, "limit", None) is not None:
        t = take_first(t, args.limit)
    if getattr(args, "time_scale", 1.0) != 1.0:
        t = scale_arrivals(t, args.time_scale)
    if not t.requests:
        raise ValueError(f"{args.trace}: the trace has no requests")
    return t


def fail(e: BaseException) -> None:
    from pymooncake.cli.main import CommandError
    raise CommandError(str(e)) from None


def check_sweep_values(args: argparse.Namespace) -> None:
    total = args.prefill + args.decode
    for v in args.values:
        if args.over == "rate":
            need_finite("--values (rate factors)", v, 0)
        elif args.over == "bandwidth":
            need_finite("--values (Gbps)", v, 0)
        elif args.over == "capacity":
            need("--values (tokens)", v, "an integral number >= 0",
                  math.isfinite(v) and v >= 0 and v == int(v))
            if args.scenario == "pd":
                usage("--over capacity: --scenario pd has no cache; use pd-local or "
                       "pd-global")
        else:
            need("--values (prefill nodes)", v,
                  f"an integer in [1, {total - 1}] (prefill nodes out of --prefill + "
                  f"--decode = {total})",
                  math.isfinite(v) and v == int(v) and 1 <= v < total)
    need("--target-attainment", args.target_attainment, "a number in [0, 1]",
          0.0 <= args.target_attainment <= 1.0)

