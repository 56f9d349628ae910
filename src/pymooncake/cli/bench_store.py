"""``pymooncake bench store``: Store put/get throughput and latency side by side with the
Mooncake wheel, and the master's metadata ops at equal in-flight depth
(``pymooncake.bench.store``, ``pymooncake.bench.store_meta``; figures in
docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from pymooncake.cli.common import add_json_flag, emit
from pymooncake.cli.store import parse_size


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench store``."""
    b = bench_subparsers.add_parser(
        "store", help="store put/get throughput and latency",
        description="Put/get throughput and p50/p99 latency of the store, bytes verified; "
        "with the mooncake-transfer-engine-non-cuda wheel importable, Mooncake's own store "
        "in the same run; and master metadata ops/s side by side at equal in-flight depth "
        "(one depth or several).")
    b.add_argument("--size", type=parse_size, action="append", default=None, metavar="BYTES",
                   help="value size (repeatable; default 4K, 64K, 1M, 16M)")
    b.add_argument("--count", type=int, default=64, help="values per size")
    b.add_argument("--mode", choices=("embedded", "remote"), action="append", default=None,
                   help="embedded: reader's own segment; remote: another process's (repeatable)")
    b.add_argument("--metadata-ops", type=int, default=20_000,
                   help="exist/get_replica_list calls for the master benchmark (0 = skip)")
    b.add_argument("--metadata-clients", type=int, action="append", default=None, metavar="N",
                   help="client processes (= calls in flight) of the side-by-side metadata "
                   "benchmark: is_exist, batch_is_exist, get_size, remove through the same "
                   "Python API on both sides; repeatable, one set of rows per depth (default "
                   "4; 0 = skip; its ops per kind: --metadata-ops)")
    b.add_argument("--metadata-only", action="store_true",
                   help="only the side-by-side metadata benchmark (no put/get rows, no "
                   "master rows)")
    b.add_argument("--no-mooncake", action="store_true", help="skip Mooncake's own store")
    b.add_argument("--rpc-poll", type=float, default=None, metavar="S",
                   help="our master's --rpc-poll in every cluster (default: its own)")
    b.add_argument("--repeat", type=int, default=1,
                   help="rounds, each with both stores up and taking turns chunk by chunk "
                        "(the one that starts swapped per round); medians with quartiles")
    b.add_argument("--mooncake-path", default=None, metavar="DIR",
                   help="a site-packages directory holding the Mooncake wheel (appended to "
                   "sys.path; its ../../../bin is searched for mooncake_master)")
    add_json_flag(b)
    b.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from pymooncake.bench import store as bench
    from pymooncake.cli.main import UsageError

    if args.count < 1:
        raise UsageError("--count must be >= 1")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    if args.mooncake_path:
        import os
        import sys

        sys.path.append(args.mooncake_path)
        bindir = os.path.normpath(os.path.join(args.mooncake_path, "..", "..", "..", "bin"))
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    sizes = args.size or [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    modes = args.mode or ["embedded", "remote"]
    depths = list(dict.fromkeys(args.metadata_clients or [4]))  # in order, once each
    if any(n < 0 for n in depths):
        raise UsageError(f"--metadata-clients {min(depths)}: must be >= 0")
    depths = [n for n in depths if n > 0]
    if args.metadata_only and not (depths and args.metadata_ops > 0):
        raise UsageError("--metadata-only needs --metadata-ops > 0 and a --metadata-clients "
                         "above 0")
    if args.rpc_poll is not None and not 0 <= args.rpc_poll <= 0.01:
        raise UsageError(f"--rpc-poll {args.rpc_poll}: must be in [0, 0.01] seconds")
    from pymooncake.bench import store_procs as bench_procs

    bench_procs.MASTER_FLAGS[:] = [] if args.rpc_poll is None else ["--rpc-poll",
                                                                     repr(args.rpc_poll)]
    result = [] if args.metadata_only else bench.run(
        sizes, args.count, modes, metadata_ops=args.metadata_ops,
        with_mooncake=not args.no_mooncake, repeat=args.repeat)
    from pymooncake.bench import store_meta

    meta = []
    if args.metadata_ops > 0:
        for n in depths:
            meta += store_meta.run(args.metadata_ops, n, repeat=args.repeat,
                                   with_mooncake=not args.no_mooncake)
    emit(result + meta, args.json,
         lambda rows: "\n".join(x for x in (bench.human(result) if result else "",
                                              store_meta.human(meta)) if x))
    return 0
