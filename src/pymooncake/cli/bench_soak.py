"""``pymooncake bench soak``: trace replay across 3 namespaced hosts with a fault every few
minutes (issue 17 Build item 7; the harness is ``pymooncake.bench.soak``). Needs root (network
namespaces) and the ``etcd`` binary."""

from __future__ import annotations

import argparse
import json
import sys


def register_bench(bench: argparse._SubParsersAction) -> None:
    from pymooncake.bench.soak import DEFAULT_TRACE, SoakOptions
    from pymooncake.bench.soak_faults import FAULTS
    from pymooncake.cli.common import add_json_flag
    d = SoakOptions()
    p = bench.add_parser(
        "soak", help="trace replay on 3 namespaced hosts with a fault every few minutes",
        description="Starts two HA Store masters and the Conductor on one namespaced host, "
        "a store-server, a prefill and a decode worker on each of two more; replays a trace "
        "while killing/freezing the master leader, killing a storage host and a prefill "
        "worker, partitioning a worker host and dropping TCP paths, one after another. "
        "Reports requests served, errors by kind, p99 TTFT before/during/after each fault, "
        "Store bytes verified and objects lost.")
    p.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of replay (default %(default)s; every fault runs at least "
                   "once even when that takes longer)")
    p.add_argument("--fault-every", type=float, default=d.fault_every_s, metavar="S",
                   help="seconds between faults (default %(default)s)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated faults, in order (default: all: %(default)s)")
    p.add_argument("--model", default=d.model, help="model (default %(default)s)")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--rps", type=float, default=d.rps, help="request rate (default %(default)s)")
    p.add_argument("--length-scale", type=int, default=d.length_scale,
                   help="divide trace lengths by this (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="cap on output tokens per request (default %(default)s)")
    p.add_argument("--window", type=float, default=d.window_s, metavar="S",
                   help="before/after window of each fault (default %(default)s s)")
    p.add_argument("--output", help="also write the JSON report to this file")
    p.add_argument("--keep-logs", metavar="DIR",
                   help="keep every role's output (stdout and stderr) in DIR, one file "
                   "per process started (default: discarded)")
    add_json_flag(p)
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from pymooncake.bench.netns import missing
    from pymooncake.bench.soak import SoakOptions, format_report, run_soak
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.cli.replay import ReplayRecord, _one
    opts = SoakOptions(duration_s=args.duration, fault_every_s=args.fault_every,
                       faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
                       model=args.model, trace=args.trace, rps=args.rps,
                       length_scale=args.length_scale, max_tokens=args.max_tokens,
                       window_s=args.window, log_dir=args.keep_logs)
    try:
        opts.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    why = missing()
    if why:
        raise CommandError(f"cannot build namespaced hosts here: {why}")
    try:
        rep = run_soak(opts, send_one=_one, new_record=ReplayRecord,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    except (RuntimeError, OSError, ValueError) as e:
        raise CommandError(f"soak: {e}") from None
    rep["command"] = "pymooncake bench soak " + " ".join(sys.argv[3:])
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(rep, fh, indent=2)
    emit(rep, args.json, format_report)
    return 0 if rep["requests_served"] > 0 else 1
